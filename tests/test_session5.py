"""``Session`` with its MQTT 5 side (``session5``): v5 encoding, properties stripped for
3.1.1, message expiry, subscription options and identifiers, the client's maximum packet
size.  Pure objects, no I/O."""

from __future__ import annotations

from mqttring.protocol.codec import decode
from mqttring.protocol.codec5 import PacketDecoder5
from mqttring.protocol.message import Message
from mqttring.protocol.packets import Publish
from mqttring.protocol.packets5 import Publish5
from mqttring.protocol.properties import Properties, PropertyId
from mqttring.protocol.session import Session
from mqttring.protocol.session5 import PublishProps, V5Session, retained_wanted

P = PropertyId
NOW = 1_800_000_000.0


def v5_session(max_packet: int = 0) -> tuple[Session, bytearray]:
    session = Session("me", True)
    session.v5 = V5Session("me", max_packet, clock=lambda: NOW)
    out = bytearray()
    session.attach(out)
    return session, out


def packets(out: bytearray) -> list[object]:
    decoder = PacketDecoder5()
    decoder.feed(bytes(out))
    return list(decoder)


def message(topic: str = "a/b", expiry: int | None = None, origin: str = "other",
            retain: bool = False) -> Message:
    items: list = [(P.USER_PROPERTY, ("k", "v"))]
    if expiry is not None:
        items.append((P.MESSAGE_EXPIRY_INTERVAL, expiry))
    props = PublishProps.from_properties(Properties(items), origin, NOW)
    return Message(topic, b"x", 1, retain, props)


def test_v5_delivery_carries_properties_and_remaining_expiry() -> None:
    session, out = v5_session()
    session.v5.clock = lambda: NOW + 25  # type: ignore[union-attr]
    session.deliver(message(expiry=60), 0)
    assert packets(out) == [Publish5("a/b", b"x", properties=Properties(
        [(P.USER_PROPERTY, ("k", "v")), (P.MESSAGE_EXPIRY_INTERVAL, 35)]))]


def test_311_delivery_strips_properties() -> None:
    session = Session("old", True)
    out = bytearray()
    session.attach(out)
    session.deliver(message(), 0)
    assert decode(bytes(out)) == Publish("a/b", b"x")


def test_expired_message_is_not_sent() -> None:
    session, out = v5_session()
    session.v5.clock = lambda: NOW + 61  # type: ignore[union-attr]
    session.deliver(message(expiry=60), 1)
    assert out == b"" and not session.inflight


def test_queued_message_expires_while_offline() -> None:
    session = Session("me", False)
    session.deliver(message(expiry=10), 1, now=NOW)
    assert session.queue[0].expires_at == NOW + 10
    out = bytearray()
    session.attach(out, NOW + 11)
    assert out == b"" and not session.queue


def test_too_large_for_the_client_is_dropped_as_if_sent() -> None:
    session, out = v5_session(max_packet=20)
    session.deliver(Message("a/b", b"y" * 40, 1), 1)
    session.deliver(Message("a/b", b"ok", 1), 1)
    assert packets(out) == [Publish5("a/b", b"ok", 1, packet_id=2)]
    assert list(session.inflight) == [2]


def test_subscription_identifiers_of_matching_filters() -> None:
    session, out = v5_session()
    session.subscriptions = {"a/#": 1, "a/+": 1, "b/#": 1}
    assert session.v5 is not None
    session.v5.set_options("a/#", 0, 3)
    session.v5.set_options("b/#", 0, 4)
    session.v5.set_options("a/+", 0, 200)
    session.deliver(Message("a/b", b"x"), 0)
    [publish] = packets(out)
    assert publish.properties.get_all(P.SUBSCRIPTION_IDENTIFIER) == [3, 200]  # type: ignore[attr-defined]


def test_no_local_and_retain_as_published() -> None:
    session, out = v5_session()
    session.subscriptions = {"a/#": 1, "r/#": 1}
    assert session.v5 is not None
    session.v5.set_options("a/#", 0x04, 0)  # No Local
    session.v5.set_options("r/#", 0x08, 0)  # Retain As Published
    session.deliver(message("a/b", origin="me"), 0)  # its own: not sent
    session.deliver(message("a/b", origin="other"), 0)
    session.deliver(message("r/x", retain=True), 0)
    assert [(p.topic, p.retain) for p in packets(out)] == [  # type: ignore[attr-defined]
        ("a/b", False), ("r/x", True)]


def test_retain_handling() -> None:
    session = Session("s", True)
    session.subscriptions = {"old": 0}
    topics = (("old", 0), ("old", 0), ("new", 0), ("new", 0), ("new", 0))
    assert retained_wanted(session, topics, (0x00, 0x10, 0x00, 0x10, 0x20)) == [
        True, False, True, True, False]
    assert retained_wanted(session, topics, None) is None



# -- options kept while a 3.1.1 client holds a v5 session -------------------------------


def kept_session(options: dict[str, int]) -> tuple[Session, bytearray]:
    """A 3.1.1 client's session that kept v5 options (``BrokerCore.bind_protocol``)."""
    session = Session("me", False)
    session.kept_options = options
    out = bytearray()
    session.attach(out)
    return session, out


def test_kept_options_apply_to_a_311_client_without_identifiers() -> None:
    from mqttring.protocol.session5 import NO_LOCAL, RETAIN_AS_PUBLISHED

    session, out = kept_session({"own/#": NO_LOCAL | 4 << 8, "rap/#": RETAIN_AS_PUBLISHED})
    session.subscriptions = {"own/#": 0, "rap/#": 0}
    session.deliver(Message("own/x", b"x", 0, False, PublishProps(origin="me")), 0)
    assert not out  # No Local
    session.deliver(Message("rap/x", b"r", 0, True), 0)
    session.deliver(Message("own/x", b"y", 0, True, PublishProps(origin="other")), 0)
    from mqttring.protocol.decoder import PacketDecoder

    decoder = PacketDecoder()
    decoder.feed(bytes(out))
    got = list(iter(decoder.next_packet, None))
    assert [(p.topic, p.payload, p.retain) for p in got] == [("rap/x", b"r", True),
                                                            ("own/x", b"y", False)]
    assert all(isinstance(p, Publish) for p in got)  # 3.1.1: no identifiers
    # Packed frames (RETAIN 0) could not honour them: one ``deliver`` each instead.
    assert not session.deliver_encoded(Message("rap/x", b"p").encode_qos0(False), 1)


def test_unsubscribe_and_the_store_keep_kept_options_exact(tmp_path: object) -> None:
    """``forget_options`` drops an unsubscribed filter's options wherever they live, and
    the store keeps the rest in the session record (``opts``), v5 or not."""
    import trio

    from mqttring.broker.session_store import SessionStore
    from mqttring.lsm import LsmStore

    session, _ = kept_session({"a/#": 0x08, "b/#": 0x04})
    session.subscriptions = {"a/#": 1, "b/#": 1}
    session.forget_options(["b/#"])
    assert session.kept_options == {"a/#": 0x08}
    with LsmStore(tmp_path / "store") as lsm:  # type: ignore[operator]
        store = SessionStore(lsm, 16)
        trio.run(store.save_subscriptions, session)
        (record,) = trio.run(store.load_all)
    assert record.options == {"a/#": 0x08}


def test_outbound_topic_aliases_first_come_first_served() -> None:
    """The first PUBLISH of a topic sets up an alias, later ones use it with an empty
    topic; past the maximum a topic goes in full, without an alias (3.3.2.3.4)."""
    session = Session("me", True)
    session.v5 = V5Session("me", alias_max=2, clock=lambda: NOW)
    out = bytearray()
    session.attach(out)
    for topic in ("a/b", "a/b", "c", "d", "a/b", "c"):
        session.deliver(Message(topic, b"x"), 0)
    alias = P.TOPIC_ALIAS
    assert packets(out) == [
        Publish5("a/b", b"x", properties=Properties([(alias, 1)])),
        Publish5("", b"x", properties=Properties([(alias, 1)])),
        Publish5("c", b"x", properties=Properties([(alias, 2)])),
        Publish5("d", b"x"),
        Publish5("", b"x", properties=Properties([(alias, 1)])),
        Publish5("", b"x", properties=Properties([(alias, 2)])),
    ]


def test_aliased_publish_golden_bytes() -> None:
    v5 = V5Session("me", alias_max=1)
    out = bytearray()
    m = Message("ab", b"P", 1)
    assert v5.send(out, m, 1, False, False, 7)
    assert v5.send(out, m, 1, False, False, 8)
    assert bytes(out) == (
        b"\x32\x0b\x00\x02ab\x00\x07\x03\x23\x00\x01P"  # topic, id 7, props: alias 1
        b"\x32\x09\x00\x00\x00\x08\x03\x23\x00\x01P")   # empty topic, id 8, alias 1


def test_a_publish_too_large_for_the_client_sets_up_no_alias() -> None:
    v5 = V5Session("me", max_packet_size=20, alias_max=4)
    out = bytearray()
    assert not v5.send(out, Message("t", b"y" * 30), 0, False, False, None)
    assert v5.aliases == {}
    assert v5.send(out, Message("t", b"y"), 0, False, False, None)
    assert v5.aliases == {b"t": 1}


def test_no_aliases_without_alias_max_and_none_for_311() -> None:
    v5 = V5Session("me")
    out = bytearray()
    v5.send(out, Message("a/b", b"x"), 0, False, False, None)
    assert packets(out) == [Publish5("a/b", b"x")]
    assert v5.aliases == {}


def test_an_expired_inflight_message_is_resent_with_expiry_0() -> None:
    """Onward delivery started before the deadline, so the resend after a reconnect goes
    out [MQTT-3.3.2-5], with a remaining interval of 0, never a negative one."""
    session, out = v5_session()
    session.deliver(message(expiry=10), 1)
    [first] = packets(out)
    assert first.properties.get(P.MESSAGE_EXPIRY_INTERVAL) == 10  # type: ignore[attr-defined]
    session.detach()
    session.v5 = V5Session("me", clock=lambda: NOW + 100)
    again = bytearray()
    session.attach(again)
    [resent] = packets(again)
    assert resent.dup and resent.packet_id == first.packet_id  # type: ignore[attr-defined]
    assert resent.properties.get(P.MESSAGE_EXPIRY_INTERVAL) == 0  # type: ignore[attr-defined]
    assert session.inflight


def test_an_inflight_message_now_too_large_for_the_client_is_dropped() -> None:
    session, _ = v5_session()
    session.deliver(message(), 1)
    session.detach()
    session.v5 = V5Session("me", max_packet_size=10, clock=lambda: NOW)
    again = bytearray()
    session.attach(again)
    assert again == b"" and not session.inflight


def test_a_failed_pubrec_ends_the_qos2_delivery() -> None:
    """PUBREC >= 0x80: no PUBREL, the id is free, the next message takes the slot."""
    session = Session("me", True)
    session.limits.max_inflight = 1
    session.v5 = V5Session("me", clock=lambda: NOW)
    out = bytearray()
    session.attach(out)
    session.deliver(Message("a", b"1", 2), 2)
    session.deliver(Message("a", b"2", 2), 2)
    [first] = packets(out)
    out.clear()
    assert session.on_pubrec_failed(first.packet_id)  # type: ignore[attr-defined]
    assert not session.inflight
    session.pump()
    [second] = packets(out)
    assert second.payload == b"2"  # type: ignore[attr-defined]
    assert not session.on_pubrec_failed(first.packet_id)  # type: ignore[attr-defined]
