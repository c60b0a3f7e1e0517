"""Cluster decisions without processes or sockets: routes, anti-entropy, hops, fencing.

The multi-process tests show that routes heal in a running cluster; these pin the decisions
that make it so, on real ``ClusterView``s built by the metadata state machine:

* a route stays while any registrar holds it (two homes of one session shard overlap while
  it moves; the old home's removal must not take the new home's route with it);
* a full route set (``rsync``) replaces exactly what that registrar had, and digests agree
  on equal sets whatever their order;
* after every view change each peer is sent the routes it should hold for us;
* an owner calls a shard's routes complete only once every peer that is up sent a full set
  since it became the shard's replica, and again after a peer restarts.
"""

from __future__ import annotations

import gc
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import trio

from decision_support import NUM_SHARDS, Frames, Metadata, RecordingLinks
from mqttring.broker.metrics import BrokerMetrics
from mqttring.broker.refusals import WriteCancelled
from mqttring.broker.retained import RetainedStore
from mqttring.broker.router import LocalRouter
from mqttring.broker.session_store import SessionStore
from mqttring.cluster.delivery import Deliveries, NodeTargets, resolve
from mqttring.cluster.errors import PeerUnavailable, RoutesIncomplete, peer_failures_unwrapped
from mqttring.cluster.fencing import admit_frame
from mqttring.cluster.messages import (
    Ack,
    Delivered,
    Dlv,
    DlvEntry,
    Pub,
    RouteAdd,
    RouteDigest,
    RoutePull,
    RouteSync,
    encode_frame,
)
from mqttring.cluster.registry import RouteRegistry
from mqttring.cluster.router import MAX_HOPS, ClusterRouter
from mqttring.cluster.routes import RouteTable, route_digest
from mqttring.cluster.viewchanges import ViewChanges
from mqttring.protocol.message import Message
from mqttring.protocol.session import Session
from mqttring.raft import state as sm
from mqttring.raft.view import ClusterView, MemberState


def make_router(node: str, views: list[ClusterView], *,
                holds: Callable[[int], bool] = lambda shard: True,
                sessions: dict[str, Session] | None = None,
                max_frame: int = RecordingLinks.max_frame,
                persist: Callable[[list[Session]], Any] = lambda sessions: None,
                spawn: Callable[..., None] | None = None,
                ) -> tuple[ClusterRouter, RecordingLinks]:
    links = RecordingLinks()
    links.max_frame = max_frame
    local = LocalRouter({} if sessions is None else sessions,
                        RetainedStore(None, NUM_SHARDS),
                        SessionStore(None, NUM_SHARDS, None),  # type: ignore[arg-type]
                        BrokerMetrics(), lambda client_id: None)

    def no_task(fn: Any, *args: Any) -> None:
        raise AssertionError("no task is needed for these decisions")

    spawn = spawn or no_task
    deliveries = Deliveries(node, local, links, lambda: views[-1],  # type: ignore[arg-type]
                            persist, spawn, holds, ViewChanges(),
                            patience=30.0, request_timeout=35.0)
    registry = RouteRegistry(node, links, lambda: views[-1], spawn,  # type: ignore[arg-type]
                             lambda: homes_of(views[-1], node), routes_wait=0.2)
    router = ClusterRouter(node, local, RetainedStore(None, NUM_SHARDS), links,  # type: ignore[arg-type]
                           lambda: views[-1], BrokerMetrics(), deliveries, spawn, registry)
    return router, links


def homes_of(view: ClusterView, node: str) -> list[int]:
    """The session shards ``node`` is the (loaded) home of under ``view``."""
    return [s for s in range(view.num_shards) if view.owner(s) == node]


# -- RouteTable ---------------------------------------------------------------------------


def test_a_route_stays_while_any_registrar_holds_it() -> None:
    table = RouteTable()
    table.add("home/+/temp", "s:3", "a")  # the old home of session shard 3
    table.add("home/+/temp", "s:3", "b")  # the new home, before the old one lets go
    table.remove("home/+/temp", "s:3", "a")
    assert table.nodes_for("home/x/temp") == {"s:3"}
    table.remove("home/+/temp", "s:3", "b")
    assert table.nodes_for("home/x/temp") == set()


def test_replace_makes_a_registrar_hold_exactly_its_set() -> None:
    table = RouteTable()
    table.add("a/b", "n1", "n1")
    table.add("stale/#", "n1", "n1")
    table.add("a/b", "n2", "n2")
    added, removed = table.replace("n1", {("a/b", "n1"), ("c/+", "n1")})
    assert (added, removed) == (1, 1)
    assert table.registered_by("n1") == {("a/b", "n1"), ("c/+", "n1")}
    assert table.nodes_for("stale/x") == set()
    assert table.nodes_for("a/b") == {"n1", "n2"}
    assert table.nodes_for("c/d") == {"n1"}


def test_digest_is_order_free_and_tracks_changes() -> None:
    keys = [("a/b", "n1"), ("c/+", "s:4"), ("#", "n1")]
    assert route_digest(keys) == route_digest(list(reversed(keys)))
    table = RouteTable()
    for f, t in keys:
        table.add(f, t, "n1")
    assert table.digest_of("n1") == route_digest(keys)
    table.remove("#", "n1", "n1")
    assert table.digest_of("n1") == route_digest(keys[:2])
    assert table.digest_of("nobody") == route_digest([])


def test_a_dead_node_takes_its_own_routes_but_not_session_shard_routes() -> None:
    table = RouteTable()
    table.add("x/#", "n1", "n1")
    table.add("x/#", "s:2", "n1")
    table.drop_node("n1")
    assert table.nodes_for("x/y") == {"s:2"}
    table.drop_registrar("n1")  # removed from the cluster for good
    assert table.nodes_for("x/y") == set()


# -- RouteRegistry anti-entropy -----------------------------------------------------------


def test_every_view_change_sends_each_peer_its_full_route_set() -> None:
    meta = Metadata("a", "b", "c")
    views = [meta.view()]
    router, links = make_router("a", views)
    router.registry.local_filters[("sensors/#", "a")] = 1
    router.registry.local_filters[("only/exact", "a")] = 1
    router.on_view(ClusterView(0, None, 1, 1), views[-1])
    sets = {node: set(msg.routes) for node, msg in links.take(RouteSync)}
    assert set(sets) == {"b", "c"}
    view = views[-1]
    exact_holders = set(view.replicas(view.shard_for_topic("only/exact")))
    for node in ("b", "c"):
        assert ("sensors/#", "a") in sets[node]  # wildcards: every node
        assert (("only/exact", "a") in sets[node]) == (node in exact_holders)


def test_a_differing_digest_pulls_the_full_set() -> None:
    meta = Metadata("a", "b")
    views = [meta.view()]
    router, links = make_router("b", views)
    router.registry.on_rsync("a", RouteSync(views[-1].epoch, [("x/#", "a")], []))
    router.registry.on_rdig("a", RouteDigest(views[-1].epoch, route_digest([("x/#", "a")]), []))
    assert links.take(RoutePull) == []
    router.registry.on_rdig("a", RouteDigest(views[-1].epoch,
                                             route_digest([("x/#", "a"), ("y", "a")]), []))
    assert links.take(RoutePull) == [("a", RoutePull())]


def _many_wildcard_routes(router: ClusterRouter, count: int) -> set[tuple[str, str]]:
    """``count`` local wildcard subscriptions on ``router``'s node (held by every peer)."""
    keys = {(f"fleet/{n:06d}/commands/#", router.node_id) for n in range(count)}
    for key in keys:
        router.registry.local_filters[key] = 1
    return keys


async def test_a_subscribes_route_goes_out_in_its_own_turn_and_is_confirmed_later() -> None:
    """``add_now`` (a SUBSCRIBE registered as it is read) queues the route on the links
    before it returns, so a publish routed after it finds it; the SUBACK awaits the
    answers (``confirmed``), and a connection that ends first leaves nothing unawaited."""
    meta = Metadata("a", "b", "c")
    views = [meta.view()]
    router, links = make_router("a", views)
    router.on_view(ClusterView(0, None, 1, 1), views[-1])
    links.sent.clear()
    pending = router.registry.add_now(("x/#", "a"))
    assert pending is not None
    assert sorted(n for n, m in links.take(RouteAdd)) == ["b", "c"]  # before any await
    assert router.registry.add_now(("x/#", "a")) is None  # a second local subscriber
    await pending.confirmed()
    abandoned = router.registry.add_now(("y/#", "a"))
    assert abandoned is not None
    unraisable: list[object] = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            abandoned.abandon()
            del abandoned
            gc.collect()  # an answer never awaited and not closed warns here
    finally:
        sys.unraisablehook = hook
    assert unraisable == []


def test_a_route_set_past_half_a_frame_goes_in_parts_and_applies_whole() -> None:
    """Found by reading: one ``RouteSync`` carried the whole set, and a set past the frame
    limit (some 600,000 routes at 16 MiB) was dropped by the link, so the peer never
    counted the sender's routes complete and refused every QoS 1 publish to its shards."""
    meta = Metadata("a", "b")
    views = [meta.view()]
    sender, sent = make_router("a", views, max_frame=4096)
    keys = _many_wildcard_routes(sender, 600)
    sender.registry.sync_to("b")
    parts = [m for _, m in sent.take(RouteSync)]
    assert len(parts) > 5
    assert [m.part for m in parts] == list(range(len(parts)))
    assert [m.last for m in parts] == [False] * (len(parts) - 1) + [True]
    assert all(len(encode_frame(1, 1, [m])) <= 4096 for m in parts)
    assert {key for m in parts for key in m.routes} == keys
    receiver, _ = make_router("b", views)
    for part in parts[:-1]:
        receiver.registry.on_rsync("a", part)
        # nothing applied, nothing counted complete, until the last part
        assert receiver.routes.nodes_for("fleet/000001/commands/x") == set()
        assert "a" not in receiver.registry.synced
    receiver.registry.on_rsync("a", parts[-1])
    assert receiver.registry.synced["a"] == views[-1].epoch
    for n in (0, 299, 599):
        assert receiver.routes.nodes_for(f"fleet/{n:06d}/commands/x") == {"a"}
    assert receiver.routes.digest_of("a") == route_digest(keys)


def test_a_route_set_cut_short_is_dropped_until_sent_again() -> None:
    meta = Metadata("a", "b")
    views = [meta.view()]
    sender, sent = make_router("a", views, max_frame=4096)
    _many_wildcard_routes(sender, 600)
    sender.registry.sync_to("b")
    parts = [m for _, m in sent.take(RouteSync)]
    receiver, _ = make_router("b", views)
    receiver.registry.on_rsync("a", parts[0])
    for part in parts[2:]:  # part 1 lost with a broken link
        receiver.registry.on_rsync("a", part)
    assert "a" not in receiver.registry.synced
    assert receiver.routes.nodes_for("fleet/000599/commands/x") == set()
    # ... and a new set begun half-way through an old one replaces it
    receiver.registry.on_rsync("a", parts[0])
    receiver.registry.on_rsync("a", parts[1])
    for part in parts:
        receiver.registry.on_rsync("a", part)
    assert receiver.registry.synced["a"] == views[-1].epoch
    assert receiver.routes.digest_of("a") == route_digest({key for m in parts
                                                           for key in m.routes})


def test_session_shard_routes_survive_the_move_between_homes() -> None:
    """The old home stops asserting a session shard's routes when it unloads the shard;
    the new one asserts them only once loaded.  In between they must stay, or publishes
    are acknowledged and delivered to nobody."""
    meta = Metadata("a", "b", "c")
    views = [meta.view()]
    router, links = make_router("c", views)
    route = ("+/temp", "s:7")
    router.registry.on_rsync("a", RouteSync(5, [route, ("x", "a")], [7]))  # a: home of shard 7
    assert router.routes.nodes_for("k/temp") == {"s:7"}
    # a unloaded shard 7: silent on it
    router.registry.on_rsync("a", RouteSync(6, [("x", "a")], []))
    assert router.routes.nodes_for("k/temp") == {"s:7"}
    router.registry.on_rsync("b", RouteSync(6, [], []))  # b owns 7 but is still loading it
    assert router.routes.nodes_for("k/temp") == {"s:7"}
    router.registry.on_rsync("b", RouteSync(6, [route], [7]))  # loaded: b asserts the same route
    assert router.routes.nodes_for("k/temp") == {"s:7"}
    router.registry.on_rsync("b", RouteSync(7, [], [7]))  # its last subscriber left
    assert router.routes.nodes_for("k/temp") == set()
    # the digest covers the home's shards too
    router.registry.on_rsync("b", RouteSync(7, [route], [7]))
    router.registry.on_rdig("b", RouteDigest(7, route_digest([route]), [7]))
    assert links.take(RoutePull) == []


def test_a_route_set_from_a_newer_view_never_removes_routes_we_still_need() -> None:
    """The sender already sees our shard elsewhere and leaves its route out; we still own
    it until our own view catches up, and must keep delivering to the sender."""
    meta = Metadata("a", "b")
    views = [meta.view()]
    router, _ = make_router("a", views)
    epoch = views[-1].epoch
    router.registry.on_rsync("b", RouteSync(epoch, [("t/1", "b"), ("x/#", "b")], []))
    # a newer view than ours
    router.registry.on_rsync("b", RouteSync(epoch + 1, [("x/#", "b")], []))
    assert router.routes.nodes_for("t/1") == {"b"}
    router.registry.on_rsync("b", RouteSync(epoch, [("x/#", "b")], []))  # same view: exact set
    assert router.routes.nodes_for("t/1") == set()


def owner_a_of_three() -> tuple[Metadata, list[ClusterView], ClusterRouter, ClusterView, int]:
    """Node a's router in a settled 3-node cluster, and a shard a owns there."""
    meta = Metadata("a", "b", "c")
    views = [meta.view()]
    router, _ = make_router("a", views)
    router.on_view(ClusterView(0, None, 1, 1), views[-1])
    view = views[-1]
    return meta, views, router, view, next(s for s in range(NUM_SHARDS) if view.owner(s) == "a")


def test_a_route_set_from_an_older_view_removes_nothing_and_completes_nothing() -> None:
    """The sender computed it before it saw us live (we rejoined after a power loss as the
    owner of what we held last): it leaves out the wildcard routes we are now a target of.
    Taken as exact, it removed them, and counted as complete the owner acknowledged
    messages that reached none of those subscribers (the 5-node power-loss run)."""
    meta, views, router, view, shard = owner_a_of_three()
    route = ("x/#", f"s:{homes_of(view, 'b')[0]}")  # a persistent session homed at b
    router.registry.on_rsync("b", RouteSync(view.epoch, [route], homes_of(view, "b")))
    router.registry.on_rsync("c", RouteSync(view.epoch, [], homes_of(view, "c")))
    assert router.routes.nodes_for("x/1") == {route[1]}
    assert router.registry.routes_complete(shard, view)
    meta.down("c")  # a newer view: the shard's routes must be confirmed again
    views.append(meta.view())
    router.on_view(view, views[-1])
    newer = views[-1]
    shard = next(s for s in range(NUM_SHARDS)
                 if "a" not in view.replicas(s) and "a" in newer.replicas(s))
    assert not router.registry.routes_complete(shard, newer)
    router.registry.on_rsync("b", RouteSync(view.epoch, [], homes_of(view, "b")))  # older
    assert router.routes.nodes_for("x/1") == {route[1]}
    assert not router.registry.routes_complete(shard, newer)
    router.registry.on_rsync("b", RouteSync(newer.epoch, [route], homes_of(newer, "b")))
    assert router.registry.routes_complete(shard, newer)


def test_a_route_set_from_a_newer_view_completes_only_once_we_have_that_view() -> None:
    """Under the newer view we may no longer be a target of some of the sender's routes
    (it left them out); under ours we still need them.  Counted as complete at once, our
    owner acknowledged what it routed without them; it counts once we are at its epoch."""
    meta, views, router, view, shard = owner_a_of_three()
    router.registry.on_rsync("c", RouteSync(view.epoch, [], homes_of(view, "c")))
    meta.down("c")
    newer = meta.view()  # b's view; ours is still ``view``
    router.registry.on_rsync("b", RouteSync(newer.epoch, [], homes_of(newer, "b")))
    assert not router.registry.routes_complete(shard, view)
    views.append(newer)
    router.on_view(view, newer)
    assert router.registry.routes_complete(shard, newer)


def test_a_node_that_becomes_a_shards_replica_holds_its_own_routes_for_it() -> None:
    """Found by the 5-node partition: both replicas of a topic's shard were cut off, the
    shard went to a node that had subscribers of that topic but had registered their exact
    routes only at the replicas of the time; as owner it then missed its own subscribers.
    (A shard whose replicas are all down now waits for its last holder: it goes to another
    node once the operator removes that one.)"""
    meta = Metadata("a", "b", "c")
    views = [meta.view()]
    router, _ = make_router("a", views)
    router.on_view(ClusterView(0, None, 1, 1), views[-1])
    view = views[-1]
    topic = next(t for t in (f"t/{i}" for i in range(1000))
                 if "a" not in view.replicas(view.shard_for_topic(t)))
    router.registry.local_filters[(topic, "s:3")] = 1  # a persistent session homed here subscribes
    router.registry.local_filters[(topic, "a")] = 1  # and a clean one connected here
    meta.down("b")
    meta.down("c")
    meta.remove("c")
    views.append(meta.view())
    assert views[-1].owner(views[-1].shard_for_topic(topic)) == "a"
    router.on_view(view, views[-1])
    assert router.routes.nodes_for(topic) == {"s:3", "a"}


def test_routes_are_complete_only_after_every_up_peer_synced() -> None:
    meta, views, router, view, shard = owner_a_of_three()
    assert not router.registry.routes_complete(shard, view)
    router.registry.on_rsync("b", RouteSync(view.epoch, [], homes_of(view, "b")))
    assert not router.registry.routes_complete(shard, view)
    router.registry.on_rsync("c", RouteSync(view.epoch, [], homes_of(view, "c")))
    assert router.registry.routes_complete(shard, view)
    # c is declared down: it no longer counts.  It restarts: its new life must sync again.
    meta.down("c")
    views.append(meta.view())
    router.on_view(view, views[-1])
    assert router.registry.routes_complete(shard, views[-1])
    meta.join("c")
    views.append(meta.view())
    router.on_view(views[-2], views[-1])
    assert not router.registry.routes_complete(shard, views[-1])
    router.registry.on_rsync("c", RouteSync(views[-1].epoch, [], []))
    assert router.registry.routes_complete(shard, views[-1])


async def test_an_owner_withholds_acceptance_while_routes_are_incomplete() -> None:
    meta = Metadata("a", "b")
    views = [meta.view()]
    router, _ = make_router("a", views)
    router.on_view(ClusterView(0, None, 1, 1), views[-1])
    view = views[-1]
    shard = next(s for s in range(NUM_SHARDS) if view.owner(s) == "a")
    with pytest.raises(RoutesIncomplete):
        await router.registry.await_routes(shard)
    router.registry.on_rsync("b", RouteSync(view.epoch, [], homes_of(view, "b")))
    assert await router.registry.await_routes(shard) is view


async def test_an_owner_that_waited_for_its_routes_delivers_by_them() -> None:
    """The owner looked a message's routes up, found the shard's routes incomplete, waited
    for the route sets, and then delivered by what it had looked up before the wait: a
    persistent session whose route came in the wait missed an acknowledged message (the
    5-node power-loss run: every persistent subscriber missed one)."""
    _, _, router, view, _ = owner_a_of_three()
    links = router.links
    topic = next(t for t in (f"x/{i}" for i in range(1000))
                 if view.owner(view.shard_for_topic(t)) == "a")
    route = ("x/#", f"s:{homes_of(view, 'b')[0]}")  # a persistent session homed at b
    async with trio.open_nursery() as nursery:
        nursery.start_soon(router.accept, [Message(topic, b"m", 1)], view)
        await trio.testing.wait_all_tasks_blocked()
        assert links.take(Dlv) == []  # no route set yet: it waits
        router.registry.on_rsync("b", RouteSync(view.epoch, [route], homes_of(view, "b")))
        router.registry.on_rsync("c", RouteSync(view.epoch, [], homes_of(view, "c")))
    [(node, dlv)] = links.take(Dlv)
    assert node == "b" and [e.topic for e in dlv.entries] == [topic]


def test_after_a_start_routes_wait_for_a_loaded_home_of_every_session_shard() -> None:
    """A node back from a power loss knows no persistent session's route.  Every peer has
    sent its route set, but c, back too, has not loaded the session shards it is home of:
    their sessions' routes are unknown, so no shard's routes are complete (an owner that
    acknowledged here queued nothing for those sessions: the 5-node power-loss run lost
    messages so).  Once c's set names them, they are, and stay so after c goes."""
    meta, views, router, view, shard = owner_a_of_three()
    router.registry.on_rsync("b", RouteSync(view.epoch, [], homes_of(view, "b")))
    router.registry.on_rsync("c", RouteSync(view.epoch, [], []))  # still loading
    assert not router.registry.routes_complete(shard, view)
    router.registry.on_rsync("c", RouteSync(view.epoch, [], homes_of(view, "c")))
    assert router.registry.routes_complete(shard, view)
    meta.down("c")
    views.append(meta.view())
    router.on_view(view, views[-1])
    assert router.registry.routes_complete(shard, views[-1])


def test_a_route_set_sent_while_we_were_joining_does_not_complete_our_routes() -> None:
    """Back from a power loss, a node owns what it held last while it is still joining, but
    no peer counts it a wildcard route target until it is up: their sets of that view leave
    those routes out.  Counted as complete once it was up, the owner acknowledged a message
    that reached none of the wildcard subscribers whose routes were still on the way (the
    5-node power-loss run).  Only a set sent once we are up counts."""
    meta = Metadata("a", "b", "c")
    views = [meta.view()]
    router, _ = make_router("a", views)
    router.on_view(ClusterView(0, None, 1, 1), views[-1])

    def change(command: dict[str, Any]) -> ClusterView:
        assert meta.state.apply(command)["ok"]
        views.append(meta.view())
        router.on_view(views[-2], views[-1])
        return views[-1]

    shard = next(s for s in range(NUM_SHARDS) if set(views[-1].replicas(s)) == {"a", "b"})
    change(sm.cmd_down("b", meta.state.members["b"].incarnation))  # a: the last holder
    joining = change(sm.cmd_joining(meta.info("a")))  # a restarts
    assert joining.owner(shard) == "a"
    assert joining.members["a"].state is MemberState.JOINING
    route = ("x/#", f"s:{homes_of(joining, 'c')[0]}")  # a persistent session homed at c
    assert "a" not in router.registry.route_targets(route[0], joining)
    router.registry.on_rsync("c", RouteSync(joining.epoch, [], homes_of(joining, "c")))
    assert not router.registry.routes_complete(shard, joining)
    up = change(sm.cmd_up("a"))
    assert "a" in router.registry.route_targets(route[0], up)
    assert not router.registry.routes_complete(shard, up)
    with pytest.raises(RoutesIncomplete):
        trio.run(router.registry.await_routes, shard)
    router.registry.on_rsync("c", RouteSync(up.epoch, [route], homes_of(up, "c")))
    assert router.registry.routes_complete(shard, up)
    assert router.routes.nodes_for("x/1") == {route[1]}


# -- routing across an epoch change -------------------------------------------------------


def moved_topic(view: ClusterView, away_from: str) -> str:
    return next(t for t in (f"t/{i}" for i in range(1000))
                if view.owner(view.shard_for_topic(t)) not in (away_from, None))


async def test_a_publish_for_a_shard_that_moved_is_passed_on_with_one_more_hop() -> None:
    """The edge routed by an older epoch; we no longer own the shard: the owner of our
    (newer) epoch gets it, one hop further, and the edge hears it was accepted."""
    meta = Metadata("a", "b", "c")
    views = [meta.view()]
    router, links = make_router("a", views)
    topic = moved_topic(views[-1], "a")
    owner = views[-1].owner(views[-1].shard_for_topic(topic))
    await router._pub_task("b", 41, [Message(topic, b"x", 1, False)], 1)
    forwarded = links.take(Pub)
    assert [(n, [e.topic for e in m.messages], m.hops) for n, m in forwarded] == [
        (owner, [topic], 2)]
    assert links.take(Ack) == [("b", Ack(41, True, None))]


async def test_a_publish_past_max_hops_is_refused_not_passed_on() -> None:
    """Views that disagree for a moment must not bounce a message around forever."""
    meta = Metadata("a", "b", "c")
    views = [meta.view()]
    router, links = make_router("a", views)
    topic = moved_topic(views[-1], "a")
    await router._pub_task("b", 42, [Message(topic, b"x", 1, False)], MAX_HOPS)
    assert links.take(Pub) == []
    [(node, ack)] = links.take(Ack)
    assert node == "b" and ack.req == 42 and not ack.ok


async def test_plain_qos0_is_packed_and_a_retained_one_travels_as_a_dlv() -> None:
    """The owner's QoS 0 fan-out: plain messages keep the packed path (the frames' RETAIN 0
    is what every subscriber sees); a retained one goes in a ``Dlv`` that says RETAIN, so a
    Retain As Published subscriber on another node sees RETAIN 1 as on one broker."""
    from mqttring.cluster.wire import DELIVER

    meta = Metadata("a", "b")
    views = [meta.view()]
    router, links = make_router("a", views)
    router.routes.add("t/#", "b", "b")
    view = views[-1]
    topic = next(t for t in (f"t/{i}" for i in range(1000))
                 if view.owner(view.shard_for_topic(t)) == "a")
    plain, kept = Message(topic, b"p", 0, False), Message(topic, b"r", 0, True)
    await router.accept([plain, kept], view)
    assert links.take(Frames) == [("b", Frames(DELIVER, topic, plain.encode_qos0(False), 1))]
    [(node, dlv)] = links.take(Dlv)
    assert node == "b" and dlv.req == 0
    assert [(e.payload, e.qos, e.retain, e.clean) for e in dlv.entries] == [(b"r", 0, True, True)]


# -- deliveries whose session shard moves in flight ----------------------------------------


def test_resolve_names_each_nodes_clean_sessions_and_session_shards() -> None:
    meta = Metadata("a", "b", "c")
    view = meta.view()
    of_b, of_c = (next(s for s in range(NUM_SHARDS) if view.owner(s) == n) for n in "bc")
    by_node = resolve({"b", f"s:{of_b}", f"s:{of_c}"}, view)
    assert by_node == {"b": NodeTargets(True, [of_b]), "c": NodeTargets(False, [of_c])}


def shard_moving(before: ClusterView, after: ClusterView, frm: str, to: str) -> int:
    return next(s for s in range(NUM_SHARDS)
                if before.owner(s) == frm and after.owner(s) == to)


async def test_a_session_shard_gone_in_flight_follows_its_owner_and_spares_clean_sessions(
        autojump_clock: trio.abc.Clock) -> None:
    """One Dlv to c named c's clean sessions and the persistent sessions of a shard c
    handed to d in flight: c serves its clean sessions and names the shard; the owner then
    sends d that shard only (not c's clean sessions again, and not d's: one copy each)."""
    meta = Metadata("a", "b", "c")
    views = [meta.view()]
    router, links = make_router("a", views)
    meta.join("d")
    shard = shard_moving(views[0], meta.view(), "c", "d")

    def moved() -> Delivered:
        views.append(meta.view())
        return Delivered([(0, [shard])])

    links.answers["c"] = [moved]
    message = Message("t/1", b"x", 1)
    await router.deliveries.deliver("c", [(message, NodeTargets(True, [shard]))])
    assert [(n, e.shards, e.clean) for n, m in links.take(Dlv) for e in m.entries] == [
        ("c", [shard], True), ("d", [shard], False)]


async def test_clean_sessions_are_owed_a_delivery_while_their_node_is_in_the_view(
        autojump_clock: trio.abc.Clock) -> None:
    """A broken link does not end c's clean subscribers; c's death does."""
    meta = Metadata("a", "b", "c")
    views = [meta.view()]
    router, links = make_router("a", views)
    message = Message("t/1", b"x", 1)
    links.answers["c"] = [PeerUnavailable("c: link broke"), Delivered([])]
    await router.deliveries.deliver("c", [(message, NodeTargets(True, []))])
    assert [e.clean for _, m in links.take(Dlv) for e in m.entries] == [True, True]

    def dies() -> PeerUnavailable:
        meta.down("c")
        views.append(meta.view())
        return PeerUnavailable("c: no answer")

    links.answers["c"] = [dies]
    await router.deliveries.deliver("c", [(message, NodeTargets(True, []))])
    assert len(links.take(Dlv)) == 1


async def test_a_receiver_serves_what_it_holds_and_names_the_shards_it_does_not() -> None:
    meta = Metadata("a", "b")
    view = meta.view()
    subscriber = Session("clean-sub", True)
    router, links = make_router("b", [view], holds=lambda shard: shard != 3,
                                sessions={"clean-sub": subscriber})
    router.local.add_subscription(subscriber, "t/#", 1)
    router.deliveries.on_dlv("a", Dlv(9, [DlvEntry("t/1", b"x", 1, [3], True)]))
    assert links.take(Ack) == [("a", Ack(9, True, Delivered([(0, [3])])))]
    assert [e.message.topic for e in subscriber.queue] == ["t/1"]
    # the clean sessions had it:
    router.deliveries.on_dlv("a", Dlv(10, [DlvEntry("t/1", b"y", 1, [3], False)]))
    assert links.take(Ack) == [("a", Ack(10, True, Delivered([(0, [3])])))]
    assert [e.message.payload for e in subscriber.queue] == [b"x"]


async def test_a_delivery_whose_durable_write_was_cancelled_is_answered_not_accepted() -> None:
    """Found by the 5-node power-loss run: the durable write that carried a delivery's
    changes belonged to a task that was cancelled (a connection closed as its session
    moved); the delivery's own wait then ended in a RuntimeError, logged as a crashed task
    with a traceback, and the sender was never answered.  It is a refusal like a silent
    replica's: answered not accepted, so the sender resends."""
    meta = Metadata("a", "b")
    view = meta.view()
    subscriber = Session("p-sub", False)
    tasks: list[tuple[Any, tuple[Any, ...]]] = []

    async def persist(sessions: list[Session]) -> None:
        raise WriteCancelled("the durable write carrying these changes was cancelled")

    router, links = make_router("b", [view], sessions={"p-sub": subscriber},
                                persist=persist, spawn=lambda fn, *a: tasks.append((fn, a)))
    router.local.add_subscription(subscriber, "t/#", 1)
    shard = view.shard_for_client("p-sub")
    router.deliveries.on_dlv("a", Dlv(9, [DlvEntry("t/1", b"x", 1, [shard], False)]))
    assert links.take(Ack) == [] and len(tasks) == 1  # answered once it is durable
    fn, args = tasks.pop()
    await fn(*args)
    [(node, ack)] = links.take(Ack)
    assert (node, ack.req, ack.ok) == ("a", 9, False)


# -- fencing ------------------------------------------------------------------------------


def test_frames_of_an_ended_life_are_refused() -> None:
    meta = Metadata("a", "b", "c")
    view = meta.view()
    epoch = view.epoch
    first = view.members["c"].incarnation
    assert admit_frame(view, "a", "c", first, epoch)
    meta.down("c")  # cut off, declared down: what it sends in that life is refused
    assert not admit_frame(meta.view(), "a", "c", first, epoch)
    meta.join("c")  # rejoined in a new incarnation
    view = meta.view()
    assert admit_frame(view, "a", "c", view.members["c"].incarnation, view.epoch)
    assert not admit_frame(view, "a", "c", first, epoch)
    # A node our view does not know yet, or a newer life of one it does: joining.
    assert admit_frame(view, "a", "d", 1, view.epoch)
    assert admit_frame(view, "a", "c", view.members["c"].incarnation + 1, view.epoch)


def test_frames_packed_for_the_receivers_previous_life_are_refused() -> None:
    """A frame that sat in a send buffer across a partition reaches the healed node's new
    life stamped with an epoch from before it rejoined: the new life refuses it, whoever
    (legitimately) sent it."""
    meta = Metadata("a", "b", "c")
    before = meta.view().epoch
    meta.down("c")
    meta.join("c")
    view = meta.view()
    since = view.members["c"].since
    assert since > before
    assert not admit_frame(view, "c", "a", view.members["a"].incarnation, before)
    assert admit_frame(view, "c", "a", view.members["a"].incarnation, since)
    assert admit_frame(view, "b", "a", view.members["a"].incarnation, before)  # not c's life
    meta.down("c")  # between lives: nothing is applied
    view = meta.view()
    assert not admit_frame(view, "c", "a", view.members["a"].incarnation, view.epoch)


def test_a_rejoining_node_refuses_frames_of_its_previous_life_while_it_catches_up() -> None:
    """Its new life begins when it asks to rejoin, not when it is up: a frame that sat in a
    peer's send buffer across the partition and arrives while the node is still joining
    (catching up) is refused too (a 3-node isolation run once got a stale publish accepted
    in that window and delivered again to every subscriber)."""
    meta = Metadata("a", "b", "c")
    before = meta.view().epoch
    meta.down("c")
    assert meta.state.apply(sm.cmd_joining(meta.info("c")))["ok"]
    view = meta.view()
    mine = view.members["c"]
    assert mine.state is MemberState.JOINING and mine.since > before
    sender = view.members["a"].incarnation
    assert not admit_frame(view, "c", "a", sender, before)
    assert admit_frame(view, "c", "a", sender, mine.since)
    assert meta.state.apply(sm.cmd_up("c"))["ok"]
    assert not admit_frame(meta.view(), "c", "a", sender, before)


# -- errors across nurseries ---------------------------------------------------------------


async def test_a_peer_failure_in_a_nursery_reaches_the_caller_as_itself() -> None:
    """trio wraps task errors in an ExceptionGroup; a refused publish must still be one."""

    async def refuse() -> None:
        raise RoutesIncomplete("no route set yet")

    with pytest.raises(RoutesIncomplete), peer_failures_unwrapped():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(refuse)

    async def crash() -> None:
        raise KeyError("a bug")

    # Anything else stays what trio made it.
    with pytest.raises(BaseExceptionGroup), peer_failures_unwrapped():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(crash)
            nursery.start_soon(refuse)


# -- batches ------------------------------------------------------------------------------


async def test_a_batch_bigger_than_a_frame_travels_in_several_requests_in_order() -> None:
    """A link drops a message too big for any frame, and its requester would wait for an
    answer that never comes: a batch is cut at half the frame limit, in order."""
    meta = Metadata("a", "b")
    views = [meta.view()]
    router, links = make_router("a", views, max_frame=10_000)
    topic = moved_topic(views[-1], "a")
    messages = [Message(topic, bytes([i]) * 2_000, 1) for i in range(6)]
    await router.forward(messages, 1)
    pubs = [m for _, m in links.take(Pub)]
    assert [len(m.messages) for m in pubs] == [2, 2, 2]
    assert [e.payload[0] for m in pubs for e in m.messages] == list(range(6))

    await router.deliveries.deliver("b", [(m, NodeTargets(True, [])) for m in messages])
    dlvs = [m for _, m in links.take(Dlv)]
    assert [len(m.entries) for m in dlvs] == [2, 2, 2]
    assert [e.payload[0] for m in dlvs for e in m.entries] == list(range(6))


async def test_a_batch_goes_to_each_owner_once_and_a_refused_group_is_resent_alone(
        autojump_clock: trio.abc.Clock) -> None:
    """One ``Pub`` per owner for a batch; when one owner fails, only its messages are sent
    again (to the owner of the newer view), in their order, and the others are not."""
    meta = Metadata("a", "b", "c")
    views = [meta.view()]
    router, links = make_router("a", views)
    view = views[-1]
    of = {n: [t for t in (f"t/{i}" for i in range(2000))
              if view.owner(view.shard_for_topic(t)) == n][:2] for n in "bc"}
    messages = [Message(t, f"{t}".encode(), 1) for pair in zip(of["b"], of["c"], strict=True)
                for t in pair]
    links.answers["c"] = [PeerUnavailable("c: link broke"), None]
    await router.forward(messages, 1)
    sent = [(n, [e.topic for e in m.messages]) for n, m in links.take(Pub)]
    assert sorted(sent[:2]) == [("b", of["b"]), ("c", of["c"])]
    assert sent[2:] == [("c", of["c"])]
