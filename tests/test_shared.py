"""``mqttring.broker.shared`` and ``LocalRouter``'s share dispatch, without sockets."""

from __future__ import annotations

import random

import pytest

from mqttring.broker.metrics import BrokerMetrics
from mqttring.broker.retained import RetainedStore
from mqttring.broker.router import LocalRouter
from mqttring.broker.session_store import SessionStore
from mqttring.broker.shared import (
    Chooser,
    Placement,
    SharedFilter,
    SharedGroups,
    SharedMessage,
    Strategy,
    inner_filter,
    is_shared,
    orphans,
    parse_shared,
)
from mqttring.protocol.errors import InvalidTopic
from mqttring.protocol.message import Message
from mqttring.protocol.session import Session


@pytest.mark.parametrize("bad", ["$share", "$share/", "$share//x", "$share/g", "$share/g/",
                                 "$share/+/x", "$share/#", "$share/a+/x"])
def test_malformed_shares_are_refused(bad: str) -> None:
    assert is_shared(bad)
    with pytest.raises(InvalidTopic):
        parse_shared(bad)


def test_a_share_names_its_group_and_inner_filter() -> None:
    assert parse_shared("$share/g1/jobs/#") == SharedFilter("g1", "jobs/#")
    assert parse_shared("$share/g/a/b/+") == SharedFilter("g", "a/b/+")
    assert inner_filter("$share/g/a/+") == "a/+"
    assert inner_filter("a/+") == "a/+"
    assert not is_shared("$shared/x") and not is_shared("share/g/x") and not is_shared("$SYS/#")


def test_round_robin_rotates_per_share_and_random_covers_all() -> None:
    rr = Chooser()
    firsts = [rr.order("s1", ["a", "b", "c"])[0] for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert rr.order("s2", ["a", "b"]) == ["a", "b"]  # its own rotation
    assert sorted(rr.order("s1", ["a", "b", "c"])) == ["a", "b", "c"]
    rnd = Chooser(Strategy.RANDOM, random.Random(7))
    assert {rnd.order("s", ["a", "b", "c"])[0] for _ in range(60)} == {"a", "b", "c"}


def test_groups_match_by_inner_filter_and_keep_the_dollar_rule() -> None:
    groups = SharedGroups()
    groups.add("$share/g/#", "c1", 1)
    groups.add("$share/h/a/+", "c2", 0)
    assert sorted(groups.match("a/b")) == ["$share/g/#", "$share/h/a/+"]
    assert groups.match("$SYS/broker/uptime") == []
    assert groups.remove("$share/g/#", "c1") and not groups.remove("$share/g/#", "c1")
    assert groups.match("x") == [] and len(groups) == 1


def make_router(sessions: dict[str, Session]) -> LocalRouter:
    return LocalRouter(sessions, RetainedStore(None, 16),
                       SessionStore(None, 16, None),  # type: ignore[arg-type]
                       BrokerMetrics(), lambda client_id: None)


def online(cid: str, clean: bool = True) -> Session:
    session = Session(cid, clean)
    session.attach(bytearray())
    return session


def test_online_members_first_and_orphans_go_to_the_others() -> None:
    sessions = {"on1": online("on1"), "on2": online("on2"), "off": Session("off", False)}
    router = make_router(sessions)
    for cid in ("off", "on1", "on2"):
        router.add_subscription(sessions[cid], "$share/g/t/#", 1)
    picked = [router.deliver_to_share(Message(f"t/{i}", b"", 1), "$share/g/t/#")[1]
              for i in range(4)]
    assert [s.client_id for s in picked if s] == ["on1", "on2", "on1", "on2"]
    assert not sessions["off"].queue
    lost = orphans(sessions["on1"])
    assert [m.topic for m in lost] == ["t/0", "t/2"] and all(
        type(m) is SharedMessage for m in lost)
    router.forget(sessions.pop("on1"))  # its session ends unacknowledged
    assert [e.message.topic for e in sessions["on2"].inflight.values()] == [
        "t/1", "t/3", "t/0", "t/2"]
    # Nobody online: the offline persistent member queues; asked for online only, declined.
    sessions["on2"].detach()
    del sessions["on2"]
    router.drop_subscriptions(Session("on2", True, subscriptions={"$share/g/t/#": 1}))
    assert router.deliver_to_share(Message("t/9", b"", 1), "$share/g/t/#",
                                   offline_ok=False)[0] is Placement.OFFLINE_ONLY
    placed, session, _ = router.deliver_to_share(Message("t/9", b"", 1), "$share/g/t/#")
    assert placed is Placement.SERVED and session is sessions["off"]
    assert [e.message.topic for e in sessions["off"].queue] == ["t/9"]


def test_a_watched_copy_is_reported_gone_once_its_client_acknowledged_it() -> None:
    sessions = {"m": online("m")}
    router = make_router(sessions)
    router.add_subscription(sessions["m"], "$share/g/t", 1)
    router.deliver_to_share(Message("t", b"1", 1), "$share/g/t", origin=("owner", 7))
    router.deliver_to_share(Message("t", b"2", 1), "$share/g/t", origin=("owner", 8))
    assert router.copies.take() == {}  # both in flight
    [first, _] = sessions["m"].inflight
    sessions["m"].on_puback(first)
    assert router.copies.take() == {"owner": [7]}
    router.forget(sessions.pop("m"))  # ended: its copy is handed back (nobody left) and gone
    assert router.copies.take() == {"owner": [8]}


def test_the_share_counters_move() -> None:
    """What ``$SYS/broker/shared/*`` and ``/metrics`` report: shares with members here, copies
    placed, declines, copies handed back when a member ended unacknowledged."""
    sessions = {"m1": online("m1"), "m2": online("m2")}
    router = make_router(sessions)
    metrics = router._metrics
    router.add_subscription(sessions["m1"], "$share/g/t/#", 1)
    router.add_subscription(sessions["m2"], "$share/g/t/#", 1)
    router.add_subscription(sessions["m1"], "$share/h/t/#", 0)
    assert metrics.shared_groups == 2
    for i in range(4):
        router.deliver_to_groups(Message(f"t/{i}", b"", 1))
    assert metrics.shared_placed == 8  # each message to one member of each of two shares
    assert router.deliver_to_share(Message("t/x", b"", 1), "$share/none/t/#")[0] \
        is Placement.NO_MEMBER
    assert metrics.shared_declined == 1
    held = len(orphans(sessions["m1"]))
    assert held
    router.forget(sessions.pop("m1"))
    assert metrics.shared_redispatched == held
    assert metrics.shared_placed == 8 + held  # all to m2
    assert metrics.shared_groups == 1
