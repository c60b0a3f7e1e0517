"""What a view change costs the event loop: work in proportion to what changed.

A node that held 100k retained messages and 10k persistent sessions blocked its trio loop
for 1-4 s at each view change (a third node joining, then leaving), walking and hashing its
whole state, and its own heartbeats (trio tasks) went late enough for it to fence itself.
These pin, without processes:

* the retained topics of shards no longer held are found through a per-shard index, and only
  theirs are looked at, in slices with checkpoints; the whole walk (also sliced) happens only
  for the first view and when pins move topics;
* a node that takes shards over reads and decodes only their sessions, in a worker thread;
* the route work proportional to every route and local filter (``settle_view``) runs in
  slices, leaves the table and the route sets exactly as the one-step version did, counts
  a newly held shard's routes complete only once our own routes are in, and a set computed
  in slices still names a route added (and leaves out one released) meanwhile.

``benchmarks/bench_view_change.py`` measures the stalls on a real 3-node cluster.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from decision_support import NUM_SHARDS, Metadata, RecordingLinks
from mqttring.broker.retained import RetainedStore
from mqttring.broker.session_store import SessionStore
from mqttring.broker.shard_writes import LocalShardWriter
from mqttring.cluster import registry as registry_module
from mqttring.cluster import shard_moves
from mqttring.cluster.messages import RouteDigest, RouteSync
from mqttring.cluster.plane import DataPlane
from mqttring.cluster.registry import RouteRegistry, route_key_size
from mqttring.lsm import Durability, LsmStore, shard_key
from mqttring.protocol.message import Message
from mqttring.protocol.session import Session, SessionLimits
from mqttring.raft.view import EMPTY_VIEW, ClusterView
from mqttring.ring.hashing import shard_of


class Ticks:
    """Counts how often other tasks ran: a step that never yields leaves it at its start."""

    def __init__(self) -> None:
        self.count = 0

    async def run(self) -> None:
        while True:
            self.count += 1
            await trio.lowlevel.checkpoint()


async def _filled(count: int, shard_for_topic: Any = None) -> RetainedStore:
    store = RetainedStore(None, NUM_SHARDS, shard_for_topic=shard_for_topic)
    await store.update_many([Message(f"r/{i % 10}/{i}", b"v", 0) for i in range(count)])
    return store


# -- retained -----------------------------------------------------------------------------


async def test_dropping_shards_looks_only_at_their_topics_in_slices() -> None:
    store = await _filled(3000)
    per_shard = Counter(shard_of(f"r/{i % 10}/{i}", NUM_SHARDS) for i in range(3000))
    store.forget_visits = 0
    ticks = Ticks()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticks.run)
        await trio.lowlevel.checkpoint()
        before = ticks.count
        forgotten = await store.drop_shards([3, 5], slice_size=20)
        yielded = ticks.count - before
        nursery.cancel_scope.cancel()
    dropped = per_shard[3] + per_shard[5]
    assert forgotten == dropped
    assert store.forget_visits == dropped  # not the 3000 topics held
    assert yielded >= dropped // 20 - 2  # a checkpoint between two slices
    assert len(store) == 3000 - dropped
    assert store.shards_held() == set(per_shard) - {3, 5}
    assert all(store.shard_for_topic(m.topic) not in (3, 5) for m in store.matching("#"))
    assert await store.drop_shards([3, 5]) == 0  # nothing left of them


async def test_the_slices_span_shards_that_hold_few_topics_each() -> None:
    store = await _filled(3000)
    ticks = Ticks()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticks.run)
        await trio.lowlevel.checkpoint()
        before = ticks.count
        # Every shard holds fewer topics than a slice; 15 of them hold more than 10 slices.
        forgotten = await store.drop_shards(range(1, NUM_SHARDS), slice_size=250)
        yielded = ticks.count - before
        nursery.cancel_scope.cancel()
    assert forgotten > 2500
    assert yielded >= forgotten // 250 - 1


async def test_drop_shards_forgets_what_forget_shards_forgot() -> None:
    keep = lambda shard: shard % 3 != 0  # noqa: E731
    whole, indexed = await _filled(1000), await _filled(1000)
    whole.forget_shards(keep)
    await indexed.drop_shards([s for s in indexed.shards_held() if not keep(s)])
    assert ({m.topic for m in whole.matching("#")}
            == {m.topic for m in indexed.matching("#")})
    assert len(whole) == len(indexed) < 1000


async def test_a_pin_change_refiles_topics_and_later_drops_follow_it() -> None:
    pinned: dict[str, int] = {}

    def shard_for_topic(topic: str) -> int:
        return pinned.get(topic.split("/")[0], shard_of(topic, NUM_SHARDS))

    store = RetainedStore(None, NUM_SHARDS, shard_for_topic=shard_for_topic)
    await store.update_many([Message(f"{root}/{i}", b"v", 0)
                             for root in ("p", "q") for i in range(200)])
    pinned["p"] = 7  # every p/ topic moves to shard 7, filed under others so far
    assert await store.reindex(lambda shard: True, slice_size=13) == 0
    assert store.forget_visits == 400
    store.forget_visits = 0
    await store.drop_shards([7])
    assert store.forget_visits == 200 + sum(1 for i in range(200)
                                            if shard_of(f"q/{i}", NUM_SHARDS) == 7)
    assert not [m for m in store.matching("#") if m.topic.startswith("p/")]


async def test_a_topic_forgotten_or_added_meanwhile_is_left_alone() -> None:
    store = await _filled(500)
    shard = next(iter(store.shards_held()))
    victims = [m.topic for m in store.matching("#") if store.shard_for_topic(m.topic) == shard]

    async def meddle() -> None:
        await trio.lowlevel.checkpoint()
        # A local clean-up during the walk, of a topic the walk has not reached yet (the
        # walk's order is a set's: fixed one here, it was sometimes visited already).
        present = {m.topic for m in store.matching("#")}
        store.apply_row(None, next(t for t in victims if t in present))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(meddle)
        forgotten = await store.drop_shards([shard], slice_size=1)
    assert forgotten == len(victims) - 1
    assert shard not in store.shards_held()


async def test_the_plane_walks_everything_only_for_its_first_view_or_new_pins() -> None:
    meta = Metadata("a", "b")
    two = meta.view()
    meta.join("c")
    three = meta.view()
    views = [two]
    store = await _filled(2000, lambda topic: views[-1].shard_for_topic(topic))
    plane: Any = SimpleNamespace(node_id="a", retained=store)
    held = lambda view: {s for s in range(view.num_shards) if "a" in view.replicas(s)}  # noqa: E731
    store.forget_visits = 0
    await DataPlane._forget_retained(plane, EMPTY_VIEW, two)  # the first view: all
    assert store.forget_visits == 2000
    kept = len(store)
    store.forget_visits = 0
    await DataPlane._forget_retained(plane, two, two)  # nothing dropped: nothing looked at
    assert store.forget_visits == 0
    views.append(three)
    await DataPlane._forget_retained(plane, two, three)
    lost = held(two) - held(three)
    assert lost
    assert store.forget_visits == kept - len(store) > 0  # only the topics of lost shards
    assert all(store.shard_for_topic(m.topic) in held(three) for m in store.matching("#"))


# -- sessions -----------------------------------------------------------------------------


async def _stored_sessions(lsm: LsmStore, count: int) -> SessionStore:
    store = SessionStore(lsm, NUM_SHARDS, LocalShardWriter(lsm))
    for i in range(count):
        session = Session(f"dev-{i}", False)
        session.subscriptions[f"dev/{i}/cmd"] = 1
        await store.save_subscriptions(session, list(session.subscriptions))
        session.deliver(Message(f"dev/{i}/cmd", b"queued", 1), 1)
        await store.save_changes([session], Durability.DURABLE)
    return store


async def test_taking_shards_over_reads_and_decodes_only_theirs_off_the_loop(
        tmp_path: Path) -> None:
    with LsmStore(tmp_path / "store") as lsm:
        store = await _stored_sessions(lsm, 200)
        scans: list[tuple[str, bytes, int]] = []
        scan_sync = lsm.scan_sync

        def spy(db: str, prefix: bytes = b"", **kwargs: Any) -> list[tuple[bytes, Any]]:
            scans.append((db, prefix, threading.get_ident()))
            return scan_sync(db, prefix, **kwargs)

        lsm.scan_sync = spy  # type: ignore[method-assign]
        gained = {2, 9}
        loaded = await store.load_shards(gained)
        expected = {f"dev-{i}" for i in range(200) if store.shard(f"dev-{i}") in gained}
        assert {s.client_id for s in loaded} == expected
        assert {prefix for _, prefix, _ in scans} == {shard_key(s) for s in gained}
        assert threading.get_ident() not in {thread for *_, thread in scans}
        everything = {s.client_id: s for s in await store.load_all()}
        for record in loaded:  # the same records as the whole store's
            assert record == everything[record.client_id]
            assert [e.message.payload for e in record.outbound] == [b"queued"]


async def test_the_plane_loads_only_the_gained_shards_in_slices(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_moves, "LOAD_SLICE", 20)
    with LsmStore(tmp_path / "store") as lsm:
        store = await _stored_sessions(lsm, 300)
        restored: list[list[str]] = []
        core = SimpleNamespace(sessions={}, session_limits=SessionLimits())
        router = SimpleNamespace(restore=lambda ss: restored.append([s.client_id for s in ss]))
        plane: Any = SimpleNamespace(session_store=store, core=core, router=router,
                                     config=SimpleNamespace(moved_session_grace=5.0),
                                     node_id="a")
        gained = set(range(0, NUM_SHARDS, 2))
        await DataPlane._load(plane, gained)
        expected = {f"dev-{i}" for i in range(300) if store.shard(f"dev-{i}") in gained}
        assert set(core.sessions) == expected
        assert len(restored) > 1  # restored slice by slice
        assert sorted(c for run in restored for c in run) == sorted(expected)


# -- routes -------------------------------------------------------------------------------


def _registry(node: str, views: list[ClusterView]) -> tuple[RouteRegistry, RecordingLinks]:
    links = RecordingLinks()

    def spawn(fn: Any, *args: Any) -> None:
        """Route changes' confirmations are not awaited here: closed, with their answers."""
        for arg in args:
            if isinstance(arg, list):
                for _, answer in arg:
                    answer.close()
        fn(*args).close()

    registry = RouteRegistry(node, links, lambda: views[-1], spawn,  # type: ignore[arg-type]
                             lambda: [s for s in range(views[-1].num_shards)
                                      if views[-1].owner(s) == node], routes_wait=0.2)
    return registry, links


def _with_routes(node: str, views: list[ClusterView]) -> tuple[RouteRegistry, RecordingLinks]:
    registry, links = _registry(node, views)
    for i in range(120):
        registry.local_filters[(f"dev/{i}/cmd", "s:3" if i % 2 else node)] = 1
    for i in range(10):
        registry.local_filters[(f"fleet/{i}/#", node)] = 1
    registry.local_filters[("$share/g/jobs/1", node)] = 1
    for i in range(200):  # peers' exact routes held here, for every shard
        registry.routes.add(f"peer/{i}", "b", "b")
    registry.on_view(EMPTY_VIEW, views[-1])
    links.sent.clear()
    return registry, links


def _table(registry: RouteRegistry) -> dict[str, frozenset[Any]]:
    names = {"a", "b", "c"} | {f"home:{s}" for s in range(NUM_SHARDS)}
    return {name: registry.routes.registered_by(name) for name in names}


def _sets(links: RecordingLinks) -> dict[str, set[Any]]:
    """Each peer's route set, gathered from its parts (each within half a frame)."""
    sets: dict[str, set[Any]] = {}
    for node, message in links.take(RouteSync):
        if message.part == 0:
            sets[node] = set()
        assert sum(route_key_size(key) for key in message.routes) <= links.max_frame // 2
        sets[node].update(message.routes)
    return sets


async def test_settling_in_slices_leaves_what_one_step_left() -> None:
    meta = Metadata("a", "b")
    views = [meta.view()]
    at_once, at_once_links = _with_routes("a", views)
    sliced, sliced_links = _with_routes("a", views)
    at_once_links.max_frame = sliced_links.max_frame = 1000  # sets in several parts
    for change in (lambda: meta.join("c"), lambda: meta.down("b"),
                   lambda: meta.remove("b")):
        change()
        old = views[-1]
        views.append(meta.view())
        at_once.on_view(old, views[-1])
        sliced.on_view(old, views[-1], settle_later=True)
        await sliced.settle_view(views[-1], slice_size=7)
        assert _table(sliced) == _table(at_once)
        assert _sets(sliced_links) == _sets(at_once_links)
        assert sliced.replica_since == at_once.replica_since


async def test_a_newly_held_shard_is_complete_only_once_our_own_routes_are_in() -> None:
    meta = Metadata("a", "b", "c")
    views = [meta.view()]
    registry, _ = _registry("a", views)
    registry.on_view(EMPTY_VIEW, views[-1])
    meta.down("c")
    old = views[-1]
    views.append(meta.view())
    view = views[-1]
    gained = [s for s in range(NUM_SHARDS) if "a" in view.replicas(s)
              and "a" not in old.replicas(s)]
    assert gained
    registry.on_view(old, view, settle_later=True)
    registry.homes_known.update(range(NUM_SHARDS))
    registry.on_rsync("b", RouteSync(view.epoch, [], [s for s in range(NUM_SHARDS)
                                                      if view.owner(s) == "b"]))
    assert not registry.routes_complete(gained[0], view)
    await registry.settle_view(view)
    assert registry.routes_complete(gained[0], view)


async def test_a_set_computed_in_slices_names_routes_changed_meanwhile() -> None:
    meta = Metadata("a", "b")
    views = [meta.view()]
    registry, links = _with_routes("a", views)
    links.max_frame = 1000
    meta.join("c")
    old = views[-1]
    views.append(meta.view())
    registry.on_view(old, views[-1], settle_later=True)
    late, gone = ("late/#", "a"), ("fleet/0/#", "a")

    async def subscribe_meanwhile() -> None:
        while registry._touched is None:  # the sets are being computed
            await trio.lowlevel.checkpoint()
        pending = registry.add_now(late)
        assert pending is not None
        pending.abandon()
        registry.release(gone)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(subscribe_meanwhile)
        await registry.settle_view(views[-1], slice_size=1)
    sets = _sets(links)
    assert set(sets) == {"b", "c"}
    for node, routes in sets.items():
        assert late in routes, node
        assert gone not in routes, node
        assert routes == registry.expected_at(node, views[-1])


def test_digests_follow_route_changes_without_hashing_every_route(
        monkeypatch: pytest.MonkeyPatch) -> None:
    meta = Metadata("a", "b", "c")
    views = [meta.view()]
    registry, links = _with_routes("a", views)
    registry.send_digests()  # the first round of a view hashes every route once
    links.sent.clear()
    hashed: list[int] = []
    real = registry_module.route_digest

    def counting(keys: Any) -> int:
        keys = list(keys)
        hashed.append(len(keys))
        return real(keys)

    monkeypatch.setattr(registry_module, "route_digest", counting)
    for i in range(5):  # one SUBSCRIBE a second, for a while
        pending = registry.add_now((f"new/{i}", "a"))
        assert pending is not None
        pending.abandon()
        registry.release((f"dev/{i}/cmd", "a"))
        registry.send_digests()
    assert sum(hashed) <= 10  # each change hashed once, not the 131 routes each round
    view = views[-1]
    for node, digest in links.take(RouteDigest)[-2:]:
        assert digest.digest == real(registry.expected_at(node, view))
