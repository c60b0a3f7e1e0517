"""Shared-subscription decisions of the cluster without processes (``cluster/shared.py``).

On real ``ClusterView``s and a recording stand-in for the links: where a share's routes
live, which member target an owner asks per message, and what it does when the node it
asked declines (no member left, only offline ones) or leaves the view: the next target,
offline members last, nothing dropped while any member is left.
"""

from __future__ import annotations

import collections

import trio

from decision_support import Metadata
from mqttring.broker.shared import Placement, SharedMessage, Strategy
from mqttring.cluster.delivery import NodeTargets
from mqttring.cluster.errors import PeerUnavailable
from mqttring.cluster.messages import Ack, Delivered, Dlv, DlvEntry, SharedDone
from mqttring.cluster.routes import RouteTable, route_shard
from mqttring.cluster.shared import ShareAttempt
from mqttring.protocol.message import Message
from mqttring.protocol.session import Session
from test_cluster_decisions import make_router

SHARE = "$share/g/jobs/#"


def test_share_routes_are_apart_from_ordinary_ones_and_placed_by_the_inner_filter() -> None:
    table = RouteTable()
    table.add(SHARE, "b", "b")
    table.add(SHARE, "s:3", "home:3")
    table.add("jobs/#", "c", "c")
    assert table.nodes_for("jobs/1") == {"c"}
    assert table.shares_for("jobs/1") == {SHARE: ["b", "s:3"]}
    assert table.shares_for("$SYS/jobs") == {} and table.shared_routes == 2
    table.remove(SHARE, "b", "b")
    assert table.shares_for("jobs/1") == {SHARE: ["s:3"]}
    view = Metadata("a", "b").view()
    assert route_shard("$share/g/a/b", view) == route_shard("a/b", view) is not None
    assert route_shard("$share/g/a/+", view) is None  # a wildcard: every node


def test_an_attempt_goes_down_its_targets_and_offline_members_come_last() -> None:
    meta = Metadata("a", "b", "c")
    view = meta.view()
    shard_of_c = next(s for s in range(view.num_shards) if view.owner(s) == "c")
    attempt = ShareAttempt(Message("jobs/1", b"", 1), SHARE, ["b", f"s:{shard_of_c}", "c"])
    node, (_, targets) = attempt.next(view)
    assert node == "b" and targets == NodeTargets(True, [], SHARE, False)
    attempt.declined(Placement.OFFLINE_ONLY)  # b: only an offline persistent member
    node, (_, targets) = attempt.next(view)
    assert node == "c" and targets == NodeTargets(False, [shard_of_c], SHARE, False)
    attempt.declined(Placement.NO_MEMBER)
    node, (_, targets) = attempt.next(view)
    assert node == "c" and targets == NodeTargets(True, [], SHARE, False)
    attempt.declined(Placement.NO_MEMBER)
    # Every target asked: b, which had only offline members, again with offline_ok.
    node, (_, targets) = attempt.next(view)
    assert node == "b" and targets.offline_ok
    attempt.declined(Placement.NO_MEMBER)
    assert attempt.next(view) is None  # nobody left: the share has no member
    meta.down("c")  # a target on a node out of the view is not asked
    assert ShareAttempt(Message("jobs/1", b"", 1), SHARE, ["c"]).next(meta.view()) is None


async def test_an_owner_rotates_over_member_nodes_and_follows_declines() -> None:
    meta = Metadata("a", "b", "c")
    views = [meta.view()]
    router, links = make_router("a", views)
    router.routes.add(SHARE, "b", "b")
    router.routes.add(SHARE, "c", "c")
    messages = [Message(f"jobs/{i}", b"", 1) for i in range(4)]
    await router.shares.run(messages)
    asked = [(n, e.topic, e.share) for n, m in links.take(Dlv) for e in m.entries]
    assert sorted(asked) == sorted([("b", "jobs/0", SHARE), ("c", "jobs/1", SHARE),
                                    ("b", "jobs/2", SHARE), ("c", "jobs/3", SHARE)])
    # b lost its member in flight (and says so), c's link broke and c left the view:
    links.answers["b"] = [Delivered([], [(0, int(Placement.NO_MEMBER))])]

    def c_dies() -> PeerUnavailable:
        meta.down("c")
        views.append(meta.view())
        return PeerUnavailable("c: gone")

    links.answers["c"] = [c_dies]
    with trio.fail_after(5):
        await router.shares.run([Message("jobs/9", b"", 1)])
    asked = [(n, e.topic) for n, m in links.take(Dlv) for e in m.entries]
    assert sorted(asked) == [("b", "jobs/9"), ("c", "jobs/9")]  # each asked once, then none


async def test_local_first_asks_the_owners_own_members_first() -> None:
    meta = Metadata("a", "b")
    views = [meta.view()]
    router, links = make_router("a", views)
    router.shares.strategy = Strategy.LOCAL_FIRST
    router.routes.add(SHARE, "b", "b")
    router.routes.add(SHARE, "a", "a")
    member = Session("m", True)
    member.attach(bytearray())
    router.local._sessions["m"] = member
    router.local.add_subscription(member, SHARE, 1)
    await router.shares.run([Message(f"jobs/{i}", b"", 1) for i in range(3)])
    assert links.take(Dlv) == []
    assert [e.message.topic for e in member.inflight.values()] == ["jobs/0", "jobs/1", "jobs/2"]


def test_a_receiver_gives_a_share_entry_to_one_member_or_declines() -> None:
    meta = Metadata("a", "b")
    view = meta.view()
    one, two, away = Session("one", True), Session("two", True), Session("away", False)
    one.attach(bytearray())
    two.attach(bytearray())
    router, links = make_router("b", [view], sessions={"one": one, "two": two, "away": away})
    for s in (one, two):
        router.local.add_subscription(s, SHARE, 1)
    entries = [DlvEntry(f"jobs/{i}", b"", 1, [], True, SHARE) for i in range(4)]
    router.deliveries.on_dlv("a", Dlv(7, entries))
    # Placed, each with the number of members online that could have taken it:
    assert links.take(Ack) == [("a", Ack(7, True, Delivered([], [], [(i, 2) for i in range(4)])))]
    assert [len(one.inflight), len(two.inflight)] == [2, 2]
    assert all(type(e.message) is SharedMessage for e in one.inflight.values())
    # Only an offline persistent member of the shard named: declined unless offline_ok.
    shard = router.local._session_store.shard("away")
    router.local.add_subscription(away, SHARE, 1)
    router.deliveries.on_dlv("a", Dlv(8, [DlvEntry("jobs/x", b"", 1, [shard], False, SHARE),
                                          DlvEntry("jobs/z", b"", 1, [], True, "$share/h/x")]))
    assert links.take(Ack) == [("a", Ack(8, True, Delivered(
        [], [(0, int(Placement.OFFLINE_ONLY)), (1, int(Placement.NO_MEMBER))])))]
    assert away.queue == []
    placed, session, _ = router.local.deliver_to_share(Message("jobs/y", b"", 1), SHARE,
                                                    clean=False, shards=[shard])
    assert placed is Placement.SERVED and session is away


async def test_copies_placed_on_a_node_are_kept_until_gone_and_returned_if_it_dies() -> None:
    meta = Metadata("a", "b", "c")
    views = [meta.view()]
    router, links = make_router("a", views)
    router.routes.add(SHARE, "b", "b")
    await router.shares.run([Message(f"jobs/{i}", b"", 1) for i in range(3)])
    tokens = [e.track for _, m in links.take(Dlv) for e in m.entries]
    assert len(tokens) == 3 and all(tokens)
    router.shares.on_done("b", SharedDone(tokens[:2]))
    meta.down("b")
    lost = router.shares.on_view(meta.view())
    assert [(m.topic, m.share, type(m)) for m in lost] == [("jobs/2", SHARE, SharedMessage)]
    assert router.shares.on_view(meta.view()) == []


async def test_a_node_with_more_members_online_gets_more_turns() -> None:
    """b said it has three members online, c one: b gets three turns in four, so each of
    the four members gets a quarter (rather than b's a sixth each and c's a half)."""
    meta = Metadata("a", "b", "c")
    views = [meta.view()]
    router, links = make_router("a", views)
    router.routes.add(SHARE, "b", "b")
    router.routes.add(SHARE, "c", "c")
    links.answers["b"] = [Delivered([], [], [(0, 3)])]
    links.answers["c"] = [Delivered([], [], [(0, 1)])]
    await router.shares.run([Message("jobs/0", b"", 1), Message("jobs/1", b"", 1)])
    assert router.shares.weights == {(SHARE, "b"): 3, (SHARE, "c"): 1}
    links.take(Dlv)
    await router.shares.run([Message(f"jobs/{i}", b"", 1) for i in range(8)])
    asked = collections.Counter(n for n, m in links.take(Dlv) for _ in m.entries)
    assert asked == {"b": 6, "c": 2}
