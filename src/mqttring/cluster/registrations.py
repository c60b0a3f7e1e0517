"""The home's side of a client id: its registration (the lock), the replicas' copies,
and the will it keeps.

``mqttring.cluster.sessions`` explains the scheme (its module docstring: lock, wills,
tokens); this module is the bookkeeping a home does for it, apart from the edge's side
(opening and closing connections), which a node does for every client connected to it.
Each home holds one ``Registration`` per live client id in ``registrations`` and sends
every change to the shard's replicas (``WillRegister``/``WillDelete``), which keep it in
``replica_registrations`` and take it over when the view promotes them
(``_move_registrations``): a will outlives the home that held it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from mqttring.broker.id_locks import IdLocks
from mqttring.broker.sessions import SessionUnavailable, takeover_publishes_will, will_delay
from mqttring.cluster.errors import PeerUnavailable, RemoteError
from mqttring.cluster.links import Links
from mqttring.cluster.messages import SessionKick, WillDelete, WillRegister
from mqttring.cluster.relay import SessionRelay
from mqttring.cluster.wills import OwedWill, Wills, undelayed, will_from_wire, will_to_wire
from mqttring.protocol.packets import Will
from mqttring.protocol.packets5 import Will5
from mqttring.protocol.session import Session
from mqttring.raft.view import ClusterView

if TYPE_CHECKING:
    from mqttring.broker.client import ClientHandler
    from mqttring.broker.core import BrokerCore

log = logging.getLogger("mqttring.cluster.sessions")


@dataclass(slots=True)
class Registration:
    node: str
    token: str
    will: Will | Will5 | None
    clean: bool
    #: Set once the connection closed with an MQTT 5 will still in its Will Delay Interval:
    #: the wall-clock time it falls due.  The registration stays (here and at the replicas)
    #: until then, so the will outlives its home, and a reconnect before then cancels it.
    will_due: float | None = None
    #: The CONNECT's username: the will is checked against the ACL when it goes out.
    username: str | None = None



class HomeRegistry:
    """Registrations held as a home and as a replica, for ``ClusterSessions`` (which
    holds the state, set up and documented in its ``__init__``)."""

    node_id: str
    core: BrokerCore
    links: Links
    relay: SessionRelay
    wills: Wills
    view: Callable[[], ClusterView]
    spawn: Callable[..., None]
    fenced: Callable[[], bool]
    holds: Callable[[int], bool]
    wait_for_view_change: Callable[[float], Awaitable[None]]
    patience: float
    registrations: dict[str, Registration]
    replica_registrations: dict[str, Registration]
    by_token: dict[str, ClientHandler]
    _locks: IdLocks
    #: Tokens of connections their edge gave up on before this home registered them
    #: (``SessionClose.abandoned``), with when to forget them (``trio.current_time``).
    _abandoned: dict[str, float]
    #: Closes a connection of this node (the edge's side, ``ClusterSessions``).
    _kick_token: Callable[..., None]
    #: ``LocalSessions.session_expiry_at_close`` (``ClusterSessions`` inherits both).
    session_expiry_at_close: Callable[[Session, int], Awaitable[bool]]

    def home(self, client_id: str, view: ClusterView | None = None) -> str | None:
        view = view or self.view()
        return view.owner(view.shard_for_client(client_id))

    async def _await_loaded(self, client_id: str) -> None:
        """Bind a session only once this home has its shard's stored sessions in memory.

        A home that just took a client shard over loads that shard's sessions from its store
        while the clients of the old home are already reconnecting; binding before the load
        would answer "no session present" and shadow the stored session (and its queue).
        """
        if self.view().epoch == 0:
            return  # a single node binds what it restored at start-up
        deadline = trio.current_time() + self.patience
        while True:
            view = self.view()
            shard = view.shard_for_client(client_id)
            if view.owner(shard) not in (self.node_id, None):
                raise SessionUnavailable(f"{self.node_id} is no longer the home of {client_id!r}")
            if self.holds(shard):
                return
            if trio.current_time() >= deadline:
                raise SessionUnavailable(f"sessions of client shard {shard} still loading")
            await self.wait_for_view_change(0.2)

    def id_lock(self, client_id: str) -> AbstractAsyncContextManager[None]:
        """Hold ``client_id``'s lock: what a home does to the id's registration and to the
        attachment of its session (register, bind, serve; a close) happens one at a time
        (``IdLocks``: forgotten once nobody holds or waits for it)."""
        return self._locks.hold(client_id)

    async def register(self, client_id: str, node: str, token: str, will: Will | None,
                       clean: bool, fresh: bool = False, username: str | None = None) -> None:
        """``register_locked`` under the id's lock."""
        async with self.id_lock(client_id):
            await self.register_locked(client_id, node, token, will, clean, fresh, username)

    async def register_locked(self, client_id: str, node: str, token: str,
                              will: Will | None, clean: bool, fresh: bool = False,
                              username: str | None = None) -> None:
        """Make connection ``token`` (on ``node``) the one of ``client_id``, closing the
        previous one (takeover).  ``clean``/``fresh``: as ``bind``'s ``clean_session`` and
        ``fresh``; with both false the new connection resumes the session.  The caller
        holds ``id_lock(client_id)``, and keeps it until the session is bound and attached
        to this connection (``on_sopen``): a takeover registered in between detached the
        session from nothing, and this connection attached it afterwards for good."""
        previous = self.registrations.get(client_id)
        # Whether a taken-over connection's will goes out is decided on the session
        # as it is *before* that connection is closed: its close starts the session's
        # expiry (``ends_at``), after which the session no longer counts as resumed,
        # and a will of delay 0 went out although the new connection resumed the
        # session (MQTT 5 probe; one node and mosquitto publish none).
        will_goes = previous is None or previous.will is None or takeover_publishes_will(
            previous.will, self.core.sessions.get(client_id), clean or fresh)
        if (previous is not None and previous.token != token
                and previous.node != self.node_id and previous.will_due is None):
            # Before the new connection counts: the old one must be closed (confirmed).
            await self._kick_remote(client_id, previous)
            # Its close may have reached us meanwhile and unregistered it, publishing
            # its will: then it is no longer ours to publish.
            previous = self.registrations.get(client_id)
        view = self.view()
        if view.epoch and view.owner(view.shard_for_client(client_id)) not in (
                self.node_id, None):
            # The view moved while we waited (lock, kick): a registration kept here now
            # would outlive the view change that demoted this node's others, a stale
            # lock and will nobody ends.
            raise SessionUnavailable(f"{self.node_id} is no longer the home of "
                                     f"{client_id!r}")
        self.registrations[client_id] = Registration(node, token, will, clean,
                                                     username=username)
        self._replicate(client_id, WillRegister(client_id, node, token, will_to_wire(will),
                                                clean, username=username))
        proxy = self.relay.proxies.get(client_id)
        if proxy is not None and proxy.token != token:
            # The session serves the registered connection only: the relay it had (the
            # taken-over connection's) stops here, before the new one is served.
            self.relay.detach_proxy(client_id, proxy.token)
        if previous is not None and previous.token != token \
                and previous.will_due is not None:
            # Back within its will's delay: no will (section 3.1.3.2.2), no takeover
            # (that connection is closed already).
            log.info("delayed will of %r not published: it reconnected", client_id)
        elif previous is not None and previous.token != token:
            # Taken over: the old connection ends as the new one begins, so a will with
            # a Will Delay Interval is not published (the client id is back at once).
            log.info("takeover of client %r (%s -> %s)", client_id, previous.node, node,
                     extra={"client_id": client_id, "event": "takeover"})
            if previous.node == self.node_id:
                old = self.by_token.get(previous.token)
                if old is not None:
                    self._kick_token(previous.token)  # closes it, even mid-CONNECT
                    if old.session is not None:
                        await self.core.connection_lost(old)
            if previous.will is not None and not will_delay(previous.will):
                if will_goes:
                    self.wills.publish(client_id, previous.will, "taken over",
                                       previous.username)
                else:
                    log.info("will of %r not published: its session resumed at once",
                             client_id)

    async def _kick_remote(self, client_id: str, previous: Registration) -> None:
        """Close a taken-over connection on another node, and know it is closed.

        The edge answers once the connection is closed.  An edge that does not answer is
        waited for until the view declares it down: a node cut off from the majority fences
        itself (closes every connection) before it can be declared down.  Past ``patience``
        the new connection is refused instead (``SessionUnavailable``: CONNACK 3).
        """
        deadline = trio.current_time() + self.patience
        while True:
            if previous.node not in self.view().serving_members():
                return
            try:
                await self.links.request(previous.node,
                                         SessionKick(0, client_id, previous.token), 2.0)
                return
            except (PeerUnavailable, RemoteError) as exc:
                if trio.current_time() >= deadline:
                    raise SessionUnavailable(
                        f"{previous.node} did not confirm closing the previous connection of "
                        f"{client_id!r}: {exc}") from exc
                await self.wait_for_view_change(0.5)

    async def unregister(self, client_id: str, token: str, publish_will: bool,
                         reason: str, closed_at: float | None = None,
                         will_delay_at_least: float = 0.0,
                         delay_in_force: int | None = None, delay_ran: bool = False) -> bool:
        """End connection ``token``'s registration; False if it was no longer current.
        ``closed_at``: when the connection ended (wall clock), if before now: a will delay
        runs from then.  ``will_delay_at_least``: the will waits at least this long (its
        client was disconnected because its session moved: ``kick_moved``).
        ``delay_in_force``: the will's delay as the connection ended (``SessionClose``);
        None: the registered will's own.  ``delay_ran``: the will's delay timer calls."""
        current = self.registrations.get(client_id)
        if current is None or current.token != token:
            return False  # a connection that was already replaced
        self.relay.detach_proxy(client_id, token)
        if current.will_due is not None:
            # Counted as closed already (its edge left the view), its will waiting for its
            # delay.  The close itself, late (an edge that was frozen, then fenced itself
            # and closed its clients), leaves that delay running: published at once, the
            # will went out seconds early, even for a client that came back within the
            # delay (a fault probe, 7 of 10 runs).  A DISCONNECT at last cancels it.
            if not delay_ran and current.will_due > time.time():
                if publish_will:
                    return True
                current.will = None
            else:
                # Due (its timer, or an owed will back from a fence): published now.
                will = current.will
                assert will is not None
                publish_will, current.will = True, undelayed(will)
        elif publish_will and current.will is not None and not self.core.shutting_down and (
                (delay := will_delay(current.will) if delay_in_force is None
                 else delay_in_force) or will_delay_at_least):
            self._delay_will(client_id, current, reason, closed_at,
                             max(float(delay), will_delay_at_least))
            return True
        if publish_will and current.will is not None and self.fenced():
            # Cut off: no will goes out from here now.  The registration stays, here and
            # at the replicas (not told it ended), so that the majority's will keepers
            # still hold the will if this node is declared down (``OwedWill``).
            self.wills.owe(OwedWill(client_id, current.will, reason, current.username, token,
                                    current.node))
            return True
        del self.registrations[client_id]
        self._replicate(client_id, WillDelete(client_id, token))
        if publish_will:
            self.wills.publish(client_id, current.will, reason, current.username)
        return True

    def _delay_will(self, client_id: str, registration: Registration, reason: str,
                    closed_at: float | None, delay: float) -> None:
        """Keep a closed connection's registration until its will falls due (MQTT 5 Will
        Delay Interval), and tell the replicas when that is: if this home dies meanwhile,
        the replica that becomes the home publishes it on time (``on_view``)."""
        will = registration.will
        assert will is not None
        now = time.time()
        registration.will_due = min(now, closed_at or now) + delay
        log.info("will of %r on %r delayed %g s: %s", client_id, will.topic, delay, reason)
        self._replicate(client_id, WillRegister(
            client_id, registration.node, registration.token, will_to_wire(will),
            registration.clean, registration.will_due, registration.username))
        self.spawn(self._publish_will_when_due, client_id, registration.token,
                   registration.will_due)

    async def _publish_will_when_due(self, client_id: str, token: str, due: float) -> None:
        """Publish a delayed will at ``due`` if its registration is still the one held
        here: a reconnect replaced it (no will, section 3.1.3.2.2), or the view moved the
        client's home (the new home runs its own copy of this)."""
        await trio.sleep(max(0.0, due - time.time()))
        current = self.registrations.get(client_id)
        if current is None or current.token != token or current.will_due is None:
            return
        await self.unregister(client_id, token, True, "connection closed, after its will delay",
                              delay_ran=True)

    #: Seconds a home remembers a token its edge gave up on before it was registered
    #: (``note_abandoned``): longer than an edge waits for the ``sopen`` answer.
    ABANDONED_FOR = 120.0

    def note_abandoned(self, token: str) -> None:
        """Remember that connection ``token`` was given up on by its edge (``SessionClose.
        abandoned``) before this home registered it: its ``sopen`` may still be on its way
        or waiting for the lock, and must then be refused (``was_abandoned``).  Tokens are
        unique, so remembering one never refuses another connection; bounded by time."""
        now = trio.current_time()
        abandoned = self._abandoned
        if len(abandoned) >= 1024:
            for stale in [t for t, until in abandoned.items() if until <= now]:
                del abandoned[stale]
        abandoned[token] = now + self.ABANDONED_FOR

    def was_abandoned(self, token: str) -> bool:
        until = self._abandoned.pop(token, None)
        return until is not None and until > trio.current_time()

    async def end_unaccepted(self, client_id: str, token: str, expiry: int | None,
                             reason: str) -> None:
        """Undo what this home did for connection ``token`` that never became the client
        id's live one (refused here mid-CONNECT, or given up on by its edge): end its
        registration if it is still the current one, without a will (its client was never
        told it connected), and leave its session offline with its expiry running, as the
        connection's close would have (``expiry``: the Session Expiry Interval it ran on,
        None: kept).  Nothing if another connection holds the id now."""
        with trio.CancelScope(shield=True):  # also on the way out of a cancelled open
            if not await self.unregister(client_id, token, False, reason):
                return
            session = self.core.sessions.get(client_id)
            if session is None or session.output is not None:
                return  # (attached to a local connection: not this one's to end)
            if session.clean_session:
                if self.core.sessions.get(client_id) is session:
                    self.core.router.forget(session)
                    del self.core.sessions[client_id]
            elif expiry is not None:
                await self.session_expiry_at_close(session, expiry)

    def _promotion_pending(self, client_id: str, token: str) -> bool:
        """This node's view made it the home of ``client_id``, and the registration of
        ``token`` is still its replica's copy: ``on_view`` has yet to promote it.  A close
        handled meanwhile would find nothing to end, and the will would be lost."""
        copy = self.replica_registrations.get(client_id)
        return copy is not None and copy.token == token and (
            client_id not in self.registrations)

    def _replicate(self, client_id: str, message: WillRegister | WillDelete) -> None:
        """To the shard's replicas, never dropped at a full link: a replica that missed a
        registration would, promoted, publish no will for it; one that missed its end would
        publish a will for a client that said goodbye."""
        view = self.view()
        for node in view.replicas(view.shard_for_client(client_id))[1:]:
            if node != self.node_id:
                self.links.send_control(node, message)

    def on_wreg(self, message: WillRegister) -> None:
        current = self.registrations.get(message.client_id)
        if current is not None and current.token == message.token:
            # The previous home's word on a registration this node has since been promoted
            # to hold (a home that left sent it as its view moved on): the connection
            # closed, its will now waits until ``due``.  Taken as the home's own, or the
            # will went out at once when that edge left the view.
            if message.due is not None and current.will_due is None:
                current.will, current.will_due = will_from_wire(message.will), message.due
                self.spawn(self._publish_will_when_due, message.client_id, current.token,
                           message.due)
            return
        self.replica_registrations[message.client_id] = Registration(
            message.node, message.token, will_from_wire(message.will), message.clean,
            message.due, message.username)

    def on_wdel(self, message: WillDelete) -> None:
        current = self.registrations.get(message.client_id)
        if current is not None and current.token == message.token:
            # As in ``on_wreg``: the previous home ended it (a DISCONNECT, or its will went
            # out there) after this node was promoted; keeping it would publish a will
            # (again) when its edge leaves the view.
            del self.registrations[message.client_id]
            self._replicate(message.client_id, message)
            return
        current = self.replica_registrations.get(message.client_id)
        if current is not None and current.token == message.token:
            del self.replica_registrations[message.client_id]

    async def _move_registrations(self, old: ClusterView, new: ClusterView) -> None:
        """Follow a view change: promote the copies of the client shards this node now
        owns, demote (or drop) the registrations it no longer owns, give new replicas the
        will keeper's copy, and publish the wills of connections whose edge left."""
        me = self.node_id
        for client_id in list(self.replica_registrations):
            shard = new.shard_for_client(client_id)
            if new.owner(shard) == me:
                # Promoted: the copy becomes the registration (the lock, the will).
                promoted = self.replica_registrations.pop(client_id)
                if self.registrations.setdefault(client_id, promoted) is promoted \
                        and promoted.will_due is not None:
                    self.spawn(self._publish_will_when_due, client_id, promoted.token,
                               promoted.will_due)
            elif me not in new.replicas(shard):
                del self.replica_registrations[client_id]
        for client_id in [c for c in self.registrations if self.home(c, new) != me]:
            reg = self.registrations.pop(client_id)
            if self.home(client_id, new) is not None and me in new.replicas(
                new.shard_for_client(client_id)
            ):
                self.replica_registrations[client_id] = reg  # demoted to replica
        for client_id, reg in self.registrations.items():
            shard = new.shard_for_client(client_id)
            fresh = set(new.replicas(shard)[1:]) - set(old.replicas(shard) if old.epoch else ())
            for node in fresh - {me}:  # a new replica gets the will keeper's copy too
                self.links.send_control(node, WillRegister(
                    client_id, reg.node, reg.token, will_to_wire(reg.will), reg.clean,
                    reg.will_due, reg.username))
        # Not a leaving node: its clients are being sent away, each close ending its own
        # registration with the will's grace (``send_away``); what it still holds when it
        # is removed goes then.
        gone = {n for n in old.members if n not in new.serving_members()}
        for client_id, reg in list(self.registrations.items()):
            if reg.node in gone and reg.will_due is None:  # (a closed one waits its delay)
                await self.unregister(client_id, reg.token, True,
                                      f"its node {reg.node} left the view")
