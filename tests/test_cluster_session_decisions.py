"""Session registrations without processes or sockets: the races a fault run hits rarely.

A home holds one registration (edge, connection token, will) per client id; the will is
published when that registration ends uncleanly.  A registration that outlives its
connection is a will waiting to fire for a client that said DISCONNECT [MQTT-3.14.4-3], and
a lock on the client id nobody releases.  These pin the three ways one could be left:

* a connection that closes while its edge is re-registering it at a new home (the close can
  reach the home before the registration, and is then ignored);
* a home that registers a connection after the view made another node the home (the view
  change already demoted this node's registrations; this one would stay);
* an edge that restarts and hands out the tokens of its previous life again.

And one way a will could be lost: a home that is fenced when a connection of a live edge
closes, then declared down before it serves again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from decision_support import NUM_SHARDS, Metadata, RecordingLinks
from mqttring.broker.client import ClientHandler
from mqttring.broker.core import BrokerCore
from mqttring.broker.metrics import BrokerMetrics
from mqttring.broker.retained import RetainedStore
from mqttring.broker.router import LocalRouter
from mqttring.broker.session_store import SessionStore
from mqttring.broker.sessions import SessionUnavailable
from mqttring.broker.timers import ConnectionTimers
from mqttring.cluster.messages import (
    Ack,
    SessionClose,
    SessionKick,
    SessionOpen,
    WillDelete,
    WillRegister,
)
from mqttring.cluster.sessions import ClusterSessions, home_restarted
from mqttring.cluster.viewchanges import ViewChanges
from mqttring.config import BrokerConfig
from mqttring.protocol.packets import Connect, Will
from mqttring.protocol.packets5 import Will5
from mqttring.protocol.properties import Properties, PropertyId
from mqttring.raft.view import EMPTY_VIEW, ClusterView


def make_node(node: str, views: list[ClusterView], fenced: Callable[[], bool] = lambda: False,
              ) -> tuple[BrokerCore, ClusterSessions, RecordingLinks, list[Any]]:
    """A real broker core whose session manager is the cluster's, on recorded links."""
    links = RecordingLinks()
    spawned: list[Any] = []
    holder: dict[str, ClusterSessions] = {}

    def manager(core: BrokerCore) -> ClusterSessions:
        holder["sessions"] = ClusterSessions(
            core, node, links, lambda: views[-1],  # type: ignore[arg-type]
            lambda fn, *args: spawned.append((fn, args)), fenced, lambda shard: True,
            ViewChanges().wait, patience=2.0)
        return holder["sessions"]

    store = SessionStore(None, NUM_SHARDS, None)  # type: ignore[arg-type]
    core = BrokerCore(
        BrokerConfig(), store, BrokerMetrics(),
        lambda core: LocalRouter(core.sessions, RetainedStore(None, NUM_SHARDS), store,
                                 core.metrics, lambda client_id: None),
        manager)
    return core, holder["sessions"], links, spawned


def client_homed_at(view: ClusterView, node: str) -> str:
    for k in range(1000):
        client_id = f"device-{k}"
        if view.owner(view.shard_for_client(client_id)) == node:
            return client_id
    raise AssertionError(f"no client id homed at {node}")


WILL = Will("devices/gone", b"offline", 1, False)


async def test_a_connection_closed_during_its_reregistration_is_unregistered_after_it() -> None:
    meta = Metadata("n1", "n2", "n3")
    views = [meta.view()]
    core, edge, links, _ = make_node("n1", views)
    client_id = client_homed_at(views[-1], "n2")
    handler = ClientHandler(core, None, ConnectionTimers())  # type: ignore[arg-type]
    session, _ = await edge.open(handler, client_id, Connect(
        client_id=client_id, clean_session=True, keepalive=60, will=WILL))
    handler.client_id, handler.session, handler.will = client_id, session, WILL
    answered_at: list[int] = []

    async def the_client_disconnects_before_the_home_answers() -> bool:
        handler.clean_disconnect = True
        await core.connection_lost(handler)  # its SessionClose may overtake the SessionOpen
        answered_at.append(len(links.sent))
        return True

    links.answers["n2"] = [the_client_disconnects_before_the_home_answers]
    await edge._reregister(handler, "n2")  # the home moved back to n2: register there again

    opens = [m for n, m in links.sent if n == "n2" and isinstance(m, SessionOpen)]
    assert [m.token for m in opens] == [handler.token] * len(opens) and len(opens) == 2
    after_answer = [m for n, m in links.sent[answered_at[0]:] if n == "n2"]
    # Sent after the home registered the connection, so the home ends that registration,
    # and without the will: the client said DISCONNECT.
    assert after_answer == [SessionClose(0, client_id, handler.token, False)]


async def test_a_home_never_registers_a_connection_once_the_view_moved_the_client_away(
) -> None:
    meta = Metadata("n1", "n2", "n3")
    views = [meta.view()]
    _, home, links, _ = make_node("n1", views)
    client_id = client_homed_at(views[-1], "n1")
    await home.register(client_id, "n3", "n3:a:1", WILL, True)
    assert home.registrations[client_id].token == "n3:a:1"

    def old_edge_confirms_after_the_view_moved() -> bool:
        meta.down("n1")  # the majority declared this home down meanwhile: n1 is no home now
        views.append(meta.view())
        return True

    links.answers["n3"] = [old_edge_confirms_after_the_view_moved]
    with pytest.raises(SessionUnavailable):
        await home.register(client_id, "n2", "n2:b:1", WILL, True)
    assert [m.token for _, m in links.take(SessionKick)] == ["n3:a:1"]
    # Nothing registered for the new connection here: the new home (which the edge asks
    # next) is the only one to hold it.
    assert client_id not in home.registrations or \
        home.registrations[client_id].token != "n2:b:1"
    assert all(m.token != "n2:b:1" for _, m in links.take(WillRegister))


async def test_an_edge_never_reuses_the_tokens_of_its_previous_life() -> None:
    meta = Metadata("n1", "n2", "n3")
    views = [meta.view()]
    client_id = client_homed_at(views[-1], "n2")
    tokens = []
    for _life in range(2):
        core, edge, links, _ = make_node("n1", views)
        handler = ClientHandler(core, None, ConnectionTimers())  # type: ignore[arg-type]
        with trio.fail_after(5):
            await edge.open(handler, client_id, Connect(
                client_id=client_id, clean_session=True, keepalive=60, will=WILL))
        tokens.append(handler.token)
        opened = links.take(SessionOpen)
        assert [m.token for _, m in opened] == [handler.token]
    assert tokens[0] != tokens[1] and all(t.startswith("n1:") for t in tokens)



async def _fenced_home_owing_two_wills() -> tuple[Metadata, list[ClusterView], list[bool],
                                                   ClusterSessions, RecordingLinks, list[Any],
                                                   str, str]:
    """Home n1, fenced, when two connections with wills close uncleanly: one of a client on
    edge n3 (alive), one of its own."""
    meta = Metadata("n1", "n2", "n3")
    views = [meta.view()]
    fenced = [False]
    _, home, links, spawned = make_node("n1", views, lambda: fenced[0])
    remote = client_homed_at(views[-1], "n1")
    local = next(f"device-{k}" for k in range(1000, 2000)
                 if views[-1].owner(views[-1].shard_for_client(f"device-{k}")) == "n1")
    await home.register(remote, "n3", "n3:a:1", REMOTE_WILL, True)
    await home.register(local, "n1", "n1:a:1", WILL, True)
    links.take(WillRegister)
    fenced[0] = True  # cut off from the majority: no will goes out from here now
    assert await home.unregister(remote, "n3:a:1", True, "closed without DISCONNECT")
    assert await home.unregister(local, "n1:a:1", True, "node fenced")
    assert spawned == []
    # The replicas are not told the registrations ended: they still hold both wills.
    assert links.take(WillDelete) == []
    assert [(o.client_id, o.token) for o in home.wills.owed] == [(remote, "n3:a:1"),
                                                               (local, "n1:a:1")]
    return meta, views, fenced, home, links, spawned, remote, local


REMOTE_WILL = Will("devices/remote", b"gone", 1, False)


async def test_wills_owed_while_fenced_go_out_when_the_home_serves_again() -> None:
    _, _, fenced, home, links, spawned, remote, local = await _fenced_home_owing_two_wills()
    fenced[0] = False  # back in the view, never declared down
    home.wills.publish_owed()
    for args in _spawned_named(spawned, "_end_registration"):
        await home._end_registration(*args)
    published = [args[0] for fn, args in spawned if fn.__name__ == "_publish_now"]
    assert published == [REMOTE_WILL, WILL] and home.wills.owed == []
    assert {m.client_id for _, m in links.take(WillDelete)} == {remote, local}
    assert remote not in home.registrations and local not in home.registrations


async def test_a_will_owed_while_fenced_survives_the_homes_death_if_its_edge_lives() -> None:
    """Declared down while fenced: the majority's will keepers hold both registrations and
    publish the one whose edge (the home itself) left the view.  The other's edge lives,
    so its registration looks current there: the home ends it at the client's new home
    once it serves again, which publishes the will (once: a takeover meanwhile would have
    changed the token).  Before 2026-11-24 the home dropped both, and told the replicas
    the registrations had ended: a 3-node packet-loss run lost a will that way."""
    meta, views, fenced, home, links, spawned, remote, _ = await _fenced_home_owing_two_wills()
    meta.down("n1")
    views.append(meta.view())
    home.wills.on_declared_down()
    await home.on_view(views[-2], views[-1])
    assert [(o.client_id, o.edge) for o in home.wills.owed] == [(remote, "n3")]
    fenced[0] = False  # rejoined, serving again (the client's home is another node now)
    new_home = views[-1].owner(views[-1].shard_for_client(remote))
    assert new_home not in ("n1", None)
    home.wills.publish_owed()
    assert [fn.__name__ for fn, _ in spawned] == ["_end_registration"]
    assert home.wills.owed == []
    for fn, args in spawned:
        await fn(*args)
    assert links.take(SessionClose) == [(new_home, SessionClose(0, remote, "n3:a:1", True))]


DELAYED_WILL = Will5("devices/late", b"offline", 1, False,
                     Properties(((PropertyId.WILL_DELAY_INTERVAL, 30),)))  # type: ignore[arg-type]


def _spawned_named(spawned: list[Any], name: str) -> list[tuple[Any, ...]]:
    return [args for fn, args in spawned if fn.__name__ == name]


async def _home_with_a_delayed_will(meta: Metadata, views: list[ClusterView]
                                    ) -> tuple[ClusterSessions, RecordingLinks, list[Any],
                                               str, WillRegister]:
    """Home n1 of a client on edge n3 whose connection closed uncleanly with a will delayed
    30 s; returns what n1 told the replicas."""
    _, home, links, spawned = make_node("n1", views)
    client_id = client_homed_at(views[-1], "n1")
    await home.register(client_id, "n3", "n3:a:1", DELAYED_WILL, True)
    links.take(WillRegister)
    assert await home.unregister(client_id, "n3:a:1", True, "closed without DISCONNECT")
    registration = home.registrations[client_id]  # kept until the will falls due
    assert registration.will_due is not None
    told = [m for _, m in links.take(WillRegister)]
    replicas = views[-1].replicas(views[-1].shard_for_client(client_id))[1:]
    assert len(told) == len(replicas) >= 1 and all(m.due == registration.will_due
                                                   for m in told)
    assert links.take(WillDelete) == []
    assert _spawned_named(spawned, "_publish_now") == []
    return home, links, spawned, client_id, told[0]


async def test_a_delayed_will_goes_out_when_due_at_its_home(
        autojump_clock: trio.abc.Clock) -> None:
    meta = Metadata("n1", "n2", "n3")
    views = [meta.view()]
    home, links, spawned, client_id, _ = await _home_with_a_delayed_will(meta, views)
    (waiting,) = _spawned_named(spawned, "_publish_will_when_due")
    await home._publish_will_when_due(*waiting)
    (published,) = _spawned_named(spawned, "_publish_now")
    assert published[0].topic == DELAYED_WILL.topic and published[0].delay == 0
    assert client_id not in home.registrations
    assert [m.token for _, m in links.take(WillDelete)] == ["n3:a:1"]


async def test_a_reconnect_within_the_will_delay_cancels_the_will(
        autojump_clock: trio.abc.Clock) -> None:
    meta = Metadata("n1", "n2", "n3")
    views = [meta.view()]
    home, links, spawned, client_id, _ = await _home_with_a_delayed_will(meta, views)
    with trio.fail_after(5):  # no kick of the closed connection to wait for
        await home.register(client_id, "n2", "n2:b:1", None, True)
    assert links.take(SessionKick) == []
    for waiting in _spawned_named(spawned, "_publish_will_when_due"):
        await home._publish_will_when_due(*waiting)
    assert _spawned_named(spawned, "_publish_now") == []
    # Nothing else waits to publish it either.
    assert {fn.__name__ for fn, _ in spawned} == {"_publish_will_when_due"}
    assert home.registrations[client_id].token == "n2:b:1"


async def test_a_delayed_will_outlives_its_home(autojump_clock: trio.abc.Clock) -> None:
    """The home dies within the delay: the replica that becomes the home publishes the will
    when it falls due.  Before 2026-11-24 the delay ran only in a task of the home's life,
    and its replicas had been told the registration ended: the will was lost."""
    meta = Metadata("n1", "n2", "n3")
    views = [meta.view()]
    _, _, _, client_id, told = await _home_with_a_delayed_will(meta, views)
    replica = views[-1].replicas(views[-1].shard_for_client(client_id))[1]
    _, keeper, _, spawned = make_node(replica, views)
    keeper.on_wreg(told)
    meta.down("n1")
    views.append(meta.view())
    assert views[-1].owner(views[-1].shard_for_client(client_id)) == replica
    await keeper.on_view(views[-2], views[-1])
    # Its edge n3 lives, but the connection closed: nothing goes out before the delay.
    assert _spawned_named(spawned, "_publish_now") == []
    (waiting,) = _spawned_named(spawned, "_publish_will_when_due")
    await keeper._publish_will_when_due(*waiting)
    (published,) = _spawned_named(spawned, "_publish_now")
    assert published[0].topic == DELAYED_WILL.topic and published[0].delay == 0


async def _promoted_while_n1_leaves() -> tuple[Metadata, list[ClusterView], ClusterSessions,
                                               RecordingLinks, ClusterSessions, list[Any],
                                               str, str]:
    """n1, home and edge of a client, is marked leaving; the replica ``keeper`` holds the
    copy of its registration and is promoted by the view, before n1 (acting on its own,
    older view) tells it anything more."""
    meta = Metadata("n1", "n2", "n3")
    views = [meta.view()]
    _, home, links, _ = make_node("n1", list(views))  # its own, older view
    client_id = client_homed_at(views[-1], "n1")
    await home.register(client_id, "n1", "n1:a:1", WILL, True)  # n1 is its edge too
    keeper_id = views[-1].replicas(views[-1].shard_for_client(client_id))[1]
    (copy,) = [m for node, m in links.take(WillRegister) if node == keeper_id]
    _, keeper, _, spawned = make_node(keeper_id, views)
    keeper.on_wreg(copy)
    meta.leaving("n1")
    views.append(meta.view())
    assert views[-1].owner(views[-1].shard_for_client(client_id)) == keeper_id
    await keeper.on_view(views[-2], views[-1])  # promoted, not yet told of the close
    return meta, views, home, links, keeper, spawned, client_id, keeper_id


async def test_a_leaving_home_s_late_word_on_a_will_reaches_the_replica_it_promoted(
        autojump_clock: trio.abc.Clock) -> None:
    """A leaving node sends its clients away first; as a home, it delays each one's will
    and tells its replicas.  That word can reach a replica after the view made it the home
    (it was promoted with the copy that has no delay).  It must be taken as the home's own:
    before 2026-11-29 it was filed as a replica's copy, and the will went out at once when
    the leaver left the view (a fault run: every will of the leaving node's clients 0.1 s
    after the SIGTERM, though each client connected again elsewhere)."""
    meta, views, home, links, keeper, spawned, client_id, _ = await _promoted_while_n1_leaves()
    assert _spawned_named(spawned, "_publish_now") == []  # the leaver is no dead edge
    # n1 sent its client away: its will waits the moved grace (told with its old view).
    assert await home.unregister(client_id, "n1:a:1", True, "node leaving the cluster",
                                 None, 15.0)
    (late,) = [m for _, m in links.take(WillRegister)]
    assert late.due is not None
    keeper.on_wreg(late)
    meta.remove("n1")
    views.append(meta.view())
    await keeper.on_view(views[-2], views[-1])
    assert _spawned_named(spawned, "_publish_now") == []  # not at the removal either
    (waiting,) = _spawned_named(spawned, "_publish_will_when_due")
    assert keeper.registrations[client_id].will_due == late.due
    # The client connects again (through n2) within the grace: no will at all.
    await keeper.register(client_id, "n2", "n2:b:1", None, True)
    await keeper._publish_will_when_due(*waiting)
    assert _spawned_named(spawned, "_publish_now") == []


async def test_a_leaving_home_s_late_word_of_a_disconnect_ends_the_promoted_registration(
        ) -> None:
    """The same race for a clean DISCONNECT: the promoted registration must end, or the
    will would go out when the leaver is removed [MQTT-3.14.4-3]."""
    meta, views, home, links, keeper, spawned, client_id, keeper_id = \
        await _promoted_while_n1_leaves()
    assert await home.unregister(client_id, "n1:a:1", False, "DISCONNECT")
    (ended,) = [m for node, m in links.take(WillDelete) if node == keeper_id]
    keeper.on_wdel(ended)
    assert client_id not in keeper.registrations
    meta.remove("n1")
    views.append(meta.view())
    await keeper.on_view(views[-2], views[-1])
    assert _spawned_named(spawned, "_publish_now") == []


async def test_a_takeover_publishes_no_delayed_will_but_an_undelayed_one() -> None:
    """A takeover ends the old connection as the new one of the same client id begins: within
    any Will Delay Interval, so that will is not published (section 3.1.3.2.2); a will
    without a delay is."""
    meta = Metadata("n1", "n2", "n3")
    views = [meta.view()]
    _, home, _, spawned = make_node("n1", views)
    delayed, plain = (client_homed_at(views[-1], "n1"),
                      next(f"device-{k}" for k in range(1000, 2000) if views[-1].owner(
                          views[-1].shard_for_client(f"device-{k}")) == "n1"))
    await home.register(delayed, "n1", "n1:a:1", DELAYED_WILL, True)
    await home.register(plain, "n1", "n1:a:2", WILL, True)
    await home.register(delayed, "n1", "n1:a:3", None, True)
    await home.register(plain, "n1", "n1:a:4", None, True)
    assert [args[0] for args in _spawned_named(spawned, "_publish_now")] == [WILL]
    assert spawned == [(fn, args) for fn, args in spawned if fn.__name__ == "_publish_now"]


V5_WILL = Will5("devices/gone", b"offline", 1, False)


@pytest.mark.parametrize("will,clean,fresh,published", [
    (V5_WILL, False, False, False),  # resumed: a new connection to the session [MQTT-3.1.3-9]
    (V5_WILL, False, True, True),  # Clean Start with an expiry: the old session ends
    (V5_WILL, True, False, True),  # Clean Start, expiry 0: the same
    (WILL, False, False, True),  # MQTT 3.1.1: the close is no DISCONNECT [MQTT-3.1.2-8]
])
async def test_a_takeover_that_resumes_an_mqtt5_session_publishes_no_will(
        will: Will | Will5, clean: bool, fresh: bool, published: bool) -> None:
    """As on one node (``test_e2e_mqtt5.py``): the home decides, for takeovers from any
    edge, by whether the new connection resumes the persistent session it holds."""
    meta = Metadata("n1", "n2", "n3")
    views = [meta.view()]
    _, home, _, spawned = make_node("n1", views)
    client_id = client_homed_at(views[-1], "n1")
    await home.register(client_id, "n2", "n2:a:1", will, False)
    await home.bind(client_id, False)  # the persistent session, as ``on_sopen`` binds it
    await home.register(client_id, "n3", "n3:b:1", None, clean, fresh)
    assert [args[0] for args in _spawned_named(spawned, "_publish_now")] == (
        [will] if published else [])


async def _connected_then_disconnecting(home_node: str, clean_session: bool
                                       ) -> tuple[BrokerCore, ClusterSessions, RecordingLinks,
                                                  list[Any], str, Connect, ClientHandler]:
    """Node n1 of three, a client homed at ``home_node`` connected to n1 with a will, about
    to close after saying DISCONNECT."""
    meta = Metadata("n1", "n2", "n3")
    views = [meta.view()]
    core, sessions, links, spawned = make_node("n1", views)
    client_id = client_homed_at(views[-1], home_node)
    connect = Connect(client_id=client_id, clean_session=clean_session, keepalive=60,
                      will=WILL)
    first = ClientHandler(core, None, ConnectionTimers())  # type: ignore[arg-type]
    session, _ = await sessions.open(first, client_id, connect)
    first.client_id, first.session, first.will = client_id, session, WILL
    first.clean_disconnect = True
    return core, sessions, links, spawned, client_id, connect, first


async def test_a_reconnect_waits_until_its_previous_close_has_reached_the_home() -> None:
    """The edge sends a connection's close to a remote home from a task (a dying home must
    not hold it up); a reconnect of the same id on that edge waits for it, so the home
    never takes the new connection for a takeover of one that said DISCONNECT and
    publishes its will.  Before 2026-11-25 the new SessionOpen could overtake the
    SessionClose (mosquitto's 07-will-reconnect-1273.py against a 3-node cluster)."""
    core, edge, links, spawned, client_id, connect, first = \
        await _connected_then_disconnecting("n2", clean_session=True)
    await core.connection_lost(first)
    (close,) = [(fn, args) for fn, args in spawned if fn.__name__ == "_end_then_signal"]
    second = ClientHandler(core, None, ConnectionTimers())  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(edge.open, second, client_id, connect)
        await trio.testing.wait_all_tasks_blocked()
        opens = [m for _, m in links.sent if isinstance(m, SessionOpen)]
        assert [m.token for m in opens] == [first.token], "the reconnect did not wait"
        await close[0](*close[1])  # the close task runs: SessionClose reaches the home
    sent = [(type(m).__name__, m.token) for _, m in links.sent
            if isinstance(m, SessionOpen | SessionClose)]
    assert sent == [("SessionOpen", first.token), ("SessionClose", first.token),
                    ("SessionOpen", second.token)]
    (closed,) = [m for _, m in links.sent if isinstance(m, SessionClose)]
    assert not closed.publish_will  # it said DISCONNECT


async def test_a_reconnect_during_a_clean_close_at_the_home_publishes_no_will() -> None:
    """Edge and home on one node: the close of a connection that said DISCONNECT awaits
    the session store before it unregisters; a reconnect registering meanwhile is a
    takeover of that registration, which must not publish the will the DISCONNECT
    discarded [MQTT-3.14.4-3].  Before 2026-11-25 it did (mosquitto's
    07-will-reconnect-1273.py against a 3-node cluster)."""
    core, home, _, spawned, client_id, _, first = \
        await _connected_then_disconnecting("n1", clean_session=False)
    store_written = trio.Event()

    async def slow_unbind(handler: Any, session: Any) -> None:
        await store_written.wait()

    home.unbind = slow_unbind  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(core.connection_lost, first)
        await trio.testing.wait_all_tasks_blocked()
        await home.register(client_id, "n1", "n1:b:1", None, False)  # the reconnect
        store_written.set()
    assert _spawned_named(spawned, "_publish_now") == []
    assert home.registrations[client_id].token == "n1:b:1"


async def test_a_node_without_a_view_yet_refuses_to_open_a_session() -> None:
    """A restarted node is asked to open a session (its peers still see its previous life
    as the home) before its own join gave it a view.  It used to fail with an IndexError
    in the empty view and log a traceback, and a bind before that would have made a
    session no view assigned to it; it refuses, and the edge asks again by its view."""
    _, home, links, _ = make_node("n2", [EMPTY_VIEW])
    await home.on_sopen("n1", SessionOpen(7, "device-1", "n1", "n1:a:1", False, None, None))
    answers = links.take(Ack)
    assert [(n, a.req, a.ok) for n, a in answers] == [("n1", 7, False)]
    assert "no cluster view yet" in str(answers[0][1].body)
    assert "device-1" not in home.registrations
    assert "device-1" not in home.core.sessions
    assert not links.sent


def test_a_home_that_stays_the_owner_across_its_death_is_seen_restarting() -> None:
    """Both replicas of a client shard die: the last holder stays its owner while it is
    down and as it rejoins, so no view moves the shard, and an edge tells its proxied
    connections that their home's proxies are gone only by its new incarnation
    (``home_restarted``; the edge then closes them, as for a move)."""
    meta = Metadata("n1", "n2", "n3", "n4", "n5")
    first = meta.view()
    client_id = next(f"device-{k}" for k in range(1000)
                     if first.replicas(first.shard_for_client(f"device-{k}")) == ("n2", "n3"))
    shard = first.shard_for_client(client_id)
    meta.down("n3")
    one_down = meta.view()
    meta.down("n2")
    both_down = meta.view()
    meta.join("n2")
    back = meta.view()
    assert {one_down.owner(shard), both_down.owner(shard), back.owner(shard)} == {"n2"}
    assert not home_restarted(first, one_down, "n2")
    assert not home_restarted(one_down, both_down, "n2")  # down: the same life, ended
    assert home_restarted(both_down, back, "n2")
    assert home_restarted(one_down, back, "n2")  # a view in between not installed
    assert not home_restarted(back, back, "n2")
    assert not home_restarted(EMPTY_VIEW, first, "n2")
    assert not home_restarted(both_down, back, None)
