"""Witness decisions without processes (``cluster/witness.py`` and its use in
``cluster/shared.py``).

Who witnesses a copy, what a witness keeps and when it gives copies back, what an owner
tells its witnesses, all on real ``ClusterView``s and a recording stand-in for the links.
"""

from __future__ import annotations

import pytest
import trio

from decision_support import Metadata, RecordingLinks
from mqttring.broker.shared import SharedMessage, Strategy
from mqttring.cluster import witness as witness_module
from mqttring.cluster.errors import PeerUnavailable
from mqttring.cluster.messages import (
    Ack,
    Dlv,
    SharedDone,
    ShareTrack,
    TrackedEntry,
)
from mqttring.cluster.router import ClusterRouter
from mqttring.cluster.witness import OwnCopies, WitnessBook, choose_witness
from mqttring.protocol.message import Message
from mqttring.protocol.session import Session
from mqttring.raft.view import ClusterView
from test_cluster_decisions import make_router

SHARE = "$share/g/jobs/#"


def copy(topic: str) -> SharedMessage:
    return SharedMessage(Message(topic, b"p", 1), SHARE)


def test_the_witness_is_the_first_live_node_of_the_preference_list_but_owner_and_member(
        ) -> None:
    meta = Metadata("a", "b", "c")
    view = meta.view()
    shard = next(s for s in range(view.num_shards) if view.owner(s) == "a")
    first, second = view.replicas(shard)
    assert first == "a"
    assert choose_witness(view, shard, ("a",)) == second  # the shard's next owner
    third = next(n for n in view.live_members() if n not in (first, second))
    assert choose_witness(view, shard, ("a", second)) == third
    meta.down(second)
    assert choose_witness(meta.view(), shard, ("a",)) == third
    assert choose_witness(meta.view(), shard, ("a", third)) is None


def test_a_witness_gives_copies_back_only_when_owner_and_member_both_left() -> None:
    meta = Metadata("a", "b", "c")
    book = WitnessBook()
    book.done("a", [3])  # reported gone before its record came: skipped when it comes
    book.track("a", "a", [(1, copy("jobs/1")), (2, copy("jobs/2")), (3, copy("jobs/3"))])
    book.track("a", "c", [(4, copy("jobs/4"))])
    book.done("a", [2])
    assert len(book) == 2 and book.lost(meta.view()) == []
    meta.down("a")
    # a's own member died with it: jobs/1 goes back; c's member lives, it keeps jobs/4.
    assert [c.topic for c in book.lost(meta.view())] == ["jobs/1"]
    assert len(book) == 1 and book.lost(meta.view()) == []
    meta.down("c")
    assert [c.topic for c in book.lost(meta.view())] == ["jobs/4"]
    assert len(book) == 0


def test_records_of_an_owner_that_left_stay_with_their_member_even_if_it_comes_back(
        ) -> None:
    """a dies; its member's node c lives and still reports under a's name; a restarts (the
    same node id); then c dies: what c still held is placed again all the same."""
    meta = Metadata("a", "b", "c")
    book = WitnessBook()
    book.track("a", "c", [(1, copy("jobs/1")), (2, copy("jobs/2"))])
    meta.down("a")
    assert book.lost(meta.view()) == []
    book.done("a", [1])  # c: acknowledged
    meta.join("a")  # a's next life
    assert "a" in meta.view().live_members() and book.lost(meta.view()) == []
    meta.down("c")
    assert [c.topic for c in book.lost(meta.view())] == ["jobs/2"]
    assert len(book) == 0


def test_witness_records_are_bounded_and_the_dropped_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(witness_module, "MAX_RECORDS", 2)
    book = WitnessBook()
    assert book.track("a", "a", [(i, copy(f"jobs/{i}")) for i in range(3)]) == 1
    assert sorted(book.records["a"]) == [1, 2]
    own = OwnCopies()
    assert [own.add(i, copy(f"jobs/{i}"), "b", "a", False) for i in range(3)] == [0, 0, 1]


def test_an_owner_tells_each_witness_of_its_copies_gone_and_moves_them_when_it_leaves(
        ) -> None:
    meta = Metadata("a", "b", "c", "d")
    own = OwnCopies()
    own.add(1, copy("jobs/1"), "b", "a", False)  # a's own member: a tells its witness
    own.add(2, copy("jobs/2"), "c", "a", False)
    own.add(3, copy("jobs/3"), "b", "a", False)
    own.add(4, copy("jobs/4"), "b", "d", True)  # d's member tells b itself
    own.add(5, copy("jobs/5"), "b", "c", True)
    assert own.gone([1, 2, 9], told=False) == {"b": [1], "c": [2]}
    assert own.gone([4], told=True) == {}
    meta.down("b")
    moved = own.rewitness(meta.view(), "a")
    # 3 goes to a witness that is neither a nor its member's node; so does 5 (not c).
    assert set(moved) <= {("c", "a"), ("d", "a"), ("d", "c")}
    assert sorted(t for records in moved.values() for t, _ in records) == [3, 5]
    assert own.records[5][1] == "d" and not own.records[5][3]  # now a tells d
    assert own.rewitness(meta.view(), "a") == {}  # already moved
    assert own.gone([5], told=True) == {"d": [5]}
    meta.down("c")
    meta.down("d")
    assert own.rewitness(meta.view(), "a") == {}  # nobody left to witness: kept here
    assert own.records[3][1] is None


def _local_first_owner() -> tuple[list[ClusterView], ClusterRouter, RecordingLinks, Session]:
    """Owner a (local_first) with a clean member here and a member target on b."""
    meta = Metadata("a", "b", "c")
    views = [meta.view()]
    router, links = make_router("a", views)
    router.shares.strategy = Strategy.LOCAL_FIRST
    router.routes.add(SHARE, "a", "a")
    router.routes.add(SHARE, "b", "b")
    member = Session("m", True)
    member.attach(bytearray())
    router.local._sessions["m"] = member
    router.local.add_subscription(member, SHARE, 1)
    return views, router, links, member


async def test_a_copy_for_the_owners_own_member_is_recorded_at_its_witness_first() -> None:
    views, router, links, member = _local_first_owner()
    topics = [f"jobs/{i}" for i in range(3)]
    await router.shares.run([Message(t, b"p", 1) for t in topics])
    tracks = links.take(ShareTrack)
    view = views[-1]
    expected = {choose_witness(view, view.shard_for_topic(t), ("a",)) for t in topics}
    assert {n for n, _ in tracks} == expected
    recorded = {e.topic: e.token for _, m in tracks for e in m.entries}
    assert sorted(recorded) == topics and all(m.member == "a" for _, m in tracks)
    assert [e.message.topic for e in member.inflight.values()] == topics
    # The client acknowledges jobs/0: its witness is told, in the next batch.
    first = next(iter(member.inflight))
    del member.inflight[first]
    router.shares.send_gone()
    [(node, done)] = links.take(SharedDone)
    witness_of_0 = choose_witness(view, view.shard_for_topic("jobs/0"), ("a",))
    assert node == witness_of_0 and done == SharedDone([recorded["jobs/0"]], "a")
    assert sorted(router.shares.own.records) == sorted(recorded[t] for t in topics[1:])


async def test_a_witness_that_does_not_answer_is_replaced_before_the_publisher_is_acked(
        ) -> None:
    views, router, links, _ = _local_first_owner()
    view = views[-1]
    topic = next(f"jobs/{i}" for i in range(100)
                 if choose_witness(view, view.shard_for_topic(f"jobs/{i}"), ("a",)) == "b")
    links.witness_answers["b"] = [PeerUnavailable("b: gone")]
    with trio.fail_after(5):
        await router.shares.run([Message(topic, b"p", 1)])
    assert [n for n, _ in links.take(ShareTrack)] == ["b", "c"]
    [(_, witness, member, direct)] = router.shares.own.records.values()
    assert (witness, member, direct) == ("c", "a", False)


async def test_a_declined_local_copy_is_cancelled_at_its_witness() -> None:
    _, router, links, member = _local_first_owner()
    router.local.unsubscribe(member, SHARE)  # left in flight: a declines
    router.routes.remove(SHARE, "b", "b")
    await router.shares.run([Message("jobs/1", b"p", 1)])
    [(witness, track)] = links.take(ShareTrack)
    assert links.take(SharedDone) == [(witness, SharedDone([track.entries[0].token], "a"))]
    assert router.shares.own.records == {}


def test_a_witness_records_answers_and_places_again_when_owner_and_member_left() -> None:
    meta = Metadata("a", "b", "c")
    router, links = make_router("b", [meta.view()])
    entries = [TrackedEntry(t, f"jobs/{t}", b"p", 1, SHARE) for t in (11, 12, 13)]
    router.shares.on_track("a", ShareTrack(5, "a", entries))
    assert links.take(Ack) == [("a", Ack(5, True))]
    router.shares.on_done("a", SharedDone([12], "a"))
    assert router.shares.on_view(meta.view()) == []
    meta.down("a")
    lost = router.shares.on_view(meta.view())
    assert sorted((m.topic, m.share, type(m)) for m in lost) == [
        ("jobs/11", SHARE, SharedMessage), ("jobs/13", SHARE, SharedMessage)]
    assert router.shares.on_view(meta.view()) == []


async def test_a_copy_on_another_node_is_recorded_at_a_third_which_the_member_tells_too(
        ) -> None:
    meta = Metadata("a", "b", "c")
    views = [meta.view()]
    router, links = make_router("a", views)
    router.routes.add(SHARE, "b", "b")
    await router.shares.run([Message("jobs/1", b"p", 1)])
    [(_, dlv)] = links.take(Dlv)
    [entry] = dlv.entries
    assert entry.track and entry.witness == "c"  # neither the owner a nor the member's b
    [(node, track)] = links.take(ShareTrack)
    assert node == "c" and track.member == "b" and track.entries[0].token == entry.track
    # b reports it gone to a, which need not tell c (b does):
    router.shares.on_done("b", SharedDone([entry.track]))
    assert links.take(SharedDone) == [] and router.shares.own.records == {}
    # The member's node: it tells both the owner and the witness.
    member = Session("m", True)
    member.attach(bytearray())
    at_b, b_links = make_router("b", [meta.view()], sessions={"m": member})
    at_b.local.add_subscription(member, SHARE, 1)
    at_b.deliveries.on_dlv("a", Dlv(0, [entry]))
    assert len(member.inflight) == 1
    member.inflight.clear()  # acknowledged
    at_b.shares.send_gone()
    assert sorted(b_links.take(SharedDone)) == [("a", SharedDone([entry.track])),
                                               ("c", SharedDone([entry.track], "a"))]


async def test_when_the_member_leaves_the_owner_places_again_then_tells_the_witness(
        ) -> None:
    meta = Metadata("a", "b", "c")
    views = [meta.view()]
    router, links = make_router("a", views)
    router.routes.add(SHARE, "b", "b")
    await router.shares.run([Message("jobs/1", b"p", 1)])
    [(_, dlv)] = links.take(Dlv)
    token = dlv.entries[0].track
    links.take(ShareTrack)
    meta.down("b")
    views.append(meta.view())
    lost = router.shares.on_view(views[-1])
    assert [m.topic for m in lost] == ["jobs/1"]
    assert links.take(SharedDone) == []  # the witness keeps it while it is placed again
    await router.shares.redispatch(lost)
    assert links.take(SharedDone) == [("c", SharedDone([token], "a"))]


async def test_when_the_witness_leaves_the_owner_records_at_another_and_tells_it(
        ) -> None:
    meta = Metadata("a", "b", "c", "d")
    views = [meta.view()]
    router, links = make_router("a", views)
    router.routes.add(SHARE, "b", "b")
    topic = next(f"jobs/{i}" for i in range(200)
                 if choose_witness(views[0], views[0].shard_for_topic(f"jobs/{i}"),
                                   ("a", "b")) == "c")
    await router.shares.run([Message(topic, b"p", 1)])
    token = links.take(Dlv)[0][1].entries[0].track
    links.take(ShareTrack)
    meta.down("c")
    assert router.shares.on_view(meta.view()) == []
    [(node, track)] = links.take(ShareTrack)
    assert node == "d" and track.member == "b" and track.entries[0].token == token
    # b still tells the witness it was given (c, gone): a tells d.
    router.shares.on_done("b", SharedDone([token]))
    assert links.take(SharedDone) == [("d", SharedDone([token], "a"))]
