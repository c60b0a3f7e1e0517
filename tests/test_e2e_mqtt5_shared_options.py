"""A shared subscription's own options apply to the copies its members get (MQTT 5).

A member's copy of a message comes through the share ``$share/{group}/{filter}``, whose
filter string never matches a topic; the session looked options up by matching filters, so
the share's were never found (found by a probe on 2026-11-28; mosquitto 2.0 applies them):
its Subscription Identifier was missing, or the client's ordinary subscription's id came
instead [MQTT-3.3.4-3]; its Retain As Published was ignored; and the No Local of the
client's ordinary subscription on the same topic dropped the share's copy, so a message
acknowledged to its publisher reached no member (No Local cannot be set on a share
[MQTT-3.8.3-4]; it belongs to the subscription that has it).
"""

from __future__ import annotations

from collections.abc import Callable

from conftest import unique
from mqtt5_support import Paho5, props

SUBSCRIBE = 8


def _connected(v5: Callable[..., Paho5], client_id: str) -> Paho5:
    client = v5(client_id)
    client.connect()
    return client


def _ids(message: object) -> list[int]:
    value = getattr(message.properties, "SubscriptionIdentifier", [])  # type: ignore[attr-defined]
    return sorted(value if isinstance(value, list) else [value])


def test_a_share_copy_carries_the_shares_subscription_identifier(
        v5: Callable[..., Paho5]) -> None:
    topic = unique("shid")
    member = _connected(v5, unique("member"))
    assert member.subscribe(f"$share/g/{topic}/+", 1,
                            props(SUBSCRIBE, SubscriptionIdentifier=22)) == [1]
    assert member.subscribe(f"{topic}/#", 1, props(SUBSCRIBE, SubscriptionIdentifier=33)) == [1]
    _connected(v5, unique("pub")).publish(f"{topic}/x", b"m", 1)
    got = sorted(_ids(member.get()) for _ in range(2))  # one copy per subscription
    assert got == [[22], [33]], got


def test_a_share_member_with_retain_as_published_gets_the_retain_flag(
        v5: Callable[..., Paho5]) -> None:
    topic = unique("shrap")
    member = _connected(v5, unique("member"))
    assert member.subscribe(f"$share/g/{topic}", 1, retainAsPublished=True) == [1]
    publisher = _connected(v5, unique("pub"))
    publisher.publish(topic, b"kept", 1, retain=True)
    publisher.publish(topic, b"live", 1)
    got = [(m.payload, m.retain) for m in (member.get(), member.get())]
    assert got == [(b"kept", True), (b"live", False)], got
    publisher.publish(topic, b"", 1, retain=True)  # (clears it)


def test_no_local_on_an_ordinary_subscription_does_not_drop_the_shares_copy(
        v5: Callable[..., Paho5]) -> None:
    """Its publishes reach the client through its share, every one, acknowledged or not."""
    topic = unique("shnl")
    client = _connected(v5, unique("both"))
    assert client.subscribe(topic, 1, noLocal=True) == [1]
    assert client.subscribe(f"$share/g/{topic}", 1) == [1]  # its only member
    for i in range(20):
        client.publish(topic, f"m{i}".encode(), 1)  # PUBACKed
    got = [client.get().payload for _ in range(20)]
    assert got == [f"m{i}".encode() for i in range(20)]
