"""Sessions in a cluster: the home node of a client id is its lock, will keeper and store.

Theory of operation
-------------------
The *home* of a client id is the owner of ``shard(client id)`` in the current view.

* **Lock.** Every CONNECT, on whichever node (the *edge*) it arrives, registers with the
  home (``sopen``), which serializes registrations of one id with a lock and remembers
  ``(edge node, connection token, will)``.  A registration that replaces a live one tells
  the old edge to close that connection (``skick``) and publishes the old will (takeover).
  Two concurrent CONNECTs with one id on two nodes are thus ordered at the home: exactly one
  stays live.  The lock covers the whole of a ``sopen`` (register, bind, and for a
  persistent session its attachment to the edge's relay) and every ``sclose``: a takeover
  registered between another connection's registration and its attachment let that
  connection attach the session afterwards, to a relay nobody read (the session then never
  expired and queued without bound).  A connection the home refuses after registering it
  is undone there; one its edge gives up on while its ``sopen`` is out (it closed, or no
  answer came) is ended by an ``sclose`` marked ``abandoned``, which the home also
  remembers for a while in case the ``sopen`` comes after it.
* **Wills** live at the home, so the will of a client whose edge node dies is still
  published: when the view marks a node down, each home publishes the wills registered for
  it.  A clean DISCONNECT (``sclose`` without will) removes the will.  An edge's close is
  acknowledged, and asked again of each newer home until one answers: a close in flight to
  a home that dies still reaches the replica that takes over.  A will with an MQTT 5 delay
  keeps its registration (and its replicas' copies) until it falls due, so the delay
  survives the home too.  How the wills go out is ``mqttring.cluster.wills``; the
  registrations a home and its replicas keep, ``mqttring.cluster.registrations``.
* **Clean sessions** live at the edge (their subscriptions route straight to it).
* **Persistent sessions** live at the home, always: their subscriptions route to the home,
  which stores every queued QoS 1/2 message and runs the ``Session`` machine.  When the
  client is connected to another node, ``mqttring.cluster.relay`` carries the session's
  bytes to that edge and the client's acknowledgements back (``SessionRelay``); this module
  decides when that relay begins (an accepted ``sopen``) and ends (the registration ends).

Fenced node (``mqttring.cluster.plane``): it refuses every CONNECT and every ``sopen`` (it
cannot prove it is still the lock for any id), and the wills it owes are held back: if the
majority declares it down, the will keepers on that side publish them; if it gets back into
the view without being declared down, it publishes them then.

Tokens: each connection has a token ``edge:life:counter``; messages about a connection carry it,
and a home ignores messages whose token is not the registered one (a late close of a
connection that was already taken over must not unregister its successor).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

import trio

from mqttring.broker.id_locks import IdLocks
from mqttring.broker.sessions import (
    LocalSessions,
    SessionUnavailable,
    cut_expiry,
    effective_will,
    expiry_at_close,
    fresh_start,
    resume_until_close,
    will_delay,
)
from mqttring.cluster.errors import PeerUnavailable, RemoteError
from mqttring.cluster.links import Links
from mqttring.cluster.messages import (
    SessionClose,
    SessionKick,
    SessionOpen,
    SessionOpened,
    V5Client,
)
from mqttring.cluster.registrations import HomeRegistry, Registration
from mqttring.cluster.relay import HomeAnswer, RemoteSession, SessionRelay
from mqttring.cluster.wills import Wills, will_from_wire, will_to_wire
from mqttring.lsm import Durability
from mqttring.protocol.packets import Connect
from mqttring.protocol.packets5 import Connect5
from mqttring.protocol.session import Session
from mqttring.raft.view import ClusterView

if TYPE_CHECKING:
    from mqttring.broker.client import ClientHandler
    from mqttring.broker.core import BrokerCore

log = logging.getLogger("mqttring.cluster.sessions")


def home_restarted(old: ClusterView, new: ClusterView, home: str | None) -> bool:
    """Did ``home`` begin a new life between ``old`` and ``new`` (a rejoin: a new
    incarnation)?  The owner of a shard whose every replica was lost stays its owner while
    it is down and rejoining (``raft/state.py``), so no move tells the edges of its proxied
    connections that the proxies it served are gone.  A connection opened with the new life
    was asked for under a view that already showed it (the new life refuses frames stamped
    with an older epoch, ``fencing.admit_frame``), so it never counts as restarted here."""
    if home is None:
        return False
    before, after = old.members.get(home), new.members.get(home)
    return before is not None and after is not None and before.incarnation != after.incarnation


class ClusterSessions(HomeRegistry, LocalSessions):
    """The cluster's ``SessionManager``; see the module docstring."""

    def __init__(self, core: BrokerCore, node_id: str, links: Links,
                 view: Callable[[], ClusterView], spawn: Callable[..., None],
                 fenced: Callable[[], bool], holds: Callable[[int], bool],
                 wait_for_view_change: Callable[[float], Awaitable[None]],
                 patience: float = 15.0, moved_grace: float = 10.0,
                 leaving: Callable[[], bool] = lambda: False) -> None:
        super().__init__(core)
        self.node_id = node_id
        self.fenced = fenced
        #: True once this node is leaving the cluster: it refuses CONNECT (``send_away``).
        self.leaving = leaving
        #: True once this node owns a client shard *and* has its stored sessions in memory.
        self.holds = holds
        self.wait_for_view_change = wait_for_view_change
        self.patience = patience
        #: Seconds the will of a client disconnected because its session moved waits for
        #: it to connect again (``kick_moved``).
        self.moved_grace = moved_grace
        #: Tokens of the connections ``kick_moved`` closed, until their close is handled.
        self._moved: set[str] = set()
        self.links = links
        self.view = view
        self.spawn = spawn
        self.registrations: dict[str, Registration] = {}
        #: Registrations of client shards this node replicates but does not own: the will
        #: keeper's copy, so a will outlives the home (and an edge that was the home).
        self.replica_registrations: dict[str, Registration] = {}
        #: Every local connection by token, from the first moment of its CONNECT: a takeover
        #: may arrive while the connection is still waiting for its home's answer.
        self.by_token: dict[str, ClientHandler] = {}
        #: The session bytes and acknowledgements of persistent sessions whose client is
        #: connected to another node than their home (``mqttring.cluster.relay``).
        self.relay = SessionRelay(core, links, patience)
        self._locks = IdLocks()
        self._abandoned: dict[str, float] = {}
        #: Closes of this edge's connections on their way to a home on another node, by
        #: client id (the latest): a new connection of the id waits for it (``open``).
        self._closing: dict[str, trio.Event] = {}
        #: Tokens are ``node:life:counter``: a restarted edge must never reuse a token its
        #: previous life registered, or a home would take a new connection for the old one.
        self._token_prefix = f"{node_id}:{secrets.token_hex(4)}"
        self._tokens = itertools.count(1)
        #: Publishes the wills this node keeps: now, after their delay, or owed while fenced.
        self.wills = Wills(node_id, core, spawn, fenced, wait_for_view_change,
                           self._end_registration)

    # -- edge side --------------------------------------------------------------------------

    async def open(self, handler: ClientHandler, client_id: str,
                   packet: Connect | Connect5) -> tuple[Session, bool]:
        """Open ``client_id``'s session through its home; asked again by each newer view
        while the home cannot answer, for up to ``patience``.

        A home killed a moment ago stays in the view for ``failure_grace``, and one that
        just took the id over may say it is not its home yet: a refusal then (CONNACK 3,
        which mosquitto_pub and mosquitto_sub give up on) told the client of a fault that
        one broker would never show it.  Its CONNACK comes late instead.  A fenced node
        refuses at once: it cannot tell whether the rest of the cluster still runs.
        """
        deadline = trio.current_time() + self.patience
        while True:
            epoch = self.view().epoch
            try:
                return await self._open_once(handler, client_id, packet)
            except SessionUnavailable as exc:
                if self.leaving():
                    raise
                while not self.fenced() and self.view().epoch == epoch:
                    remaining = deadline - trio.current_time()
                    if remaining <= 0:
                        break
                    await self.wait_for_view_change(min(remaining, 0.5))
                if self.fenced() or self.view().epoch == epoch:
                    raise
                log.debug("connect of %r: %s; asking again by view %d", client_id, exc,
                          self.view().epoch)

    async def _open_once(self, handler: ClientHandler, client_id: str,
                         packet: Connect | Connect5) -> tuple[Session, bool]:
        if self.fenced():
            raise SessionUnavailable("this node is cut off from the cluster majority")
        if self.leaving():
            raise SessionUnavailable("this node is leaving the cluster")
        closing = self._closing.get(client_id)
        if closing is not None:
            # The previous connection's close (sent by a task, not awaited) must reach the
            # home before this one's open, or the home takes this connection for a takeover
            # of one that said DISCONNECT, and publishes its will (mosquitto's
            # 07-will-reconnect-1273.py against a cluster).  Bounded as the close is.
            with trio.move_on_after(self.patience):
                await closing.wait()
        token = f"{self._token_prefix}:{next(self._tokens)}"
        handler.token = token
        self.by_token[token] = handler
        home = self.home(client_id)
        will = effective_will(packet.will, handler.conn.v5)
        until_close = resume_until_close(packet)
        # A session to resume lives at the home (persistent), so ask it as for one.
        clean = packet.clean_session and not until_close
        expiry = expiry_at_close(handler.conn.v5, self.core.limits.persistent_session_expiry)
        if home is None or home == self.node_id:
            try:
                await self._await_loaded(client_id)
            except SessionUnavailable:
                self.by_token.pop(token, None)
                raise
            async with self.id_lock(client_id):  # registered and bound as one step
                try:
                    await self.register_locked(client_id, self.node_id, token, will, clean,
                                               fresh_start(packet), packet.username)
                    bound = await self.bind(client_id, clean, fresh_start(packet),
                                            until_close,
                                            cut_expiry(handler.conn.v5,
                                                       self.core.limits.persistent_session_expiry))
                except BaseException:
                    self.by_token.pop(token, None)
                    await self.end_unaccepted(client_id, token, expiry,
                                              "connection closed before it was accepted")
                    raise
                if handler.conn.closed:
                    # Closed meanwhile: the caller drops it unaccepted, and no close would
                    # end what was just registered and bound.
                    self.by_token.pop(token, None)
                    await self.end_unaccepted(client_id, token, expiry,
                                              "connection closed before it was accepted")
            return bound
        link = handler.conn.v5
        v5 = None if link is None else V5Client(
            link.client_max_packet, link.client_receive_max, fresh_start(packet), until_close,
            link.client_alias_max, link.problem_info, cut_expiry(link, 0))
        stand_in = None if clean else self.relay.stand_in(client_id, home, token)
        try:
            answer = await self.links.request(
                home, SessionOpen(0, client_id, self.node_id, token, clean,
                                  will_to_wire(will), packet.username, v5),
                # The home may wait for its shard to load and for a previous connection to
                # be closed, each up to ``patience``: never give up before it answers.
                timeout=2 * self.patience + 5.0, expect=SessionOpened)
        except RemoteError as exc:  # refused: the home undid what it did for it
            self.relay.drop(client_id, token)
            self.by_token.pop(token, None)
            raise SessionUnavailable(f"home {home} of {client_id!r}: {exc}") from exc
        except BaseException as exc:
            # No answer (or this connection was cancelled waiting): the home may register
            # it and attach its session yet, and no close would ever end that.
            self._abandon(client_id, token, expiry)
            if isinstance(exc, PeerUnavailable):
                raise SessionUnavailable(f"home {home} of {client_id!r}: {exc}") from exc
            raise
        if handler.conn.closed:
            # Closed while its home answered (taken over by a later CONNECT, kicked): the
            # caller drops it unaccepted, so no close of it reaches the home; end there
            # what the home just opened for it (nothing if a later one holds the id).
            self._abandon(client_id, token, expiry)
            return stand_in or Session(client_id, True), False
        if stand_in is None:
            return await self.bind(client_id, True)
        stand_in.subscriptions = dict(answer.subscriptions)
        stand_in.inbound_qos2 = dict(answer.inbound_qos2)
        if answer.kept_options:  # (a copy: its publishes need the origin for No Local)
            stand_in.kept_options = dict(answer.kept_options)
        return stand_in, answer.present

    def _abandon(self, client_id: str, token: str, expiry: int | None) -> None:
        """Give up on connection ``token`` whose ``sopen`` went to the home: tell the home
        (``SessionClose.abandoned``, no will), which ends its registration and leaves its
        session offline with ``expiry`` running if it registered it, or refuses its
        ``sopen`` if that comes later.  Not awaited; a new connection of the id on this
        node waits for it, as for a close."""
        self.relay.drop(client_id, token)
        self.by_token.pop(token, None)
        done = self._closing[client_id] = trio.Event()
        self.spawn(self._end_then_signal, done, client_id, token, False, expiry,
                   time.time(), 0.0, None, True)

    async def close(self, handler: ClientHandler) -> None:
        self.by_token.pop(handler.token, None)
        session = handler.session
        assert session is not None
        owed_will = (not handler.clean_disconnect and not handler.will_forfeited
                     and not self.core.shutting_down)
        if handler.will_forfeited and handler.will is not None:
            log.info("will of %r not published: its login was revoked", session.client_id)
        handler.owed_will = owed_will
        will_delay_at_least = 0.0
        if handler.token in self._moved:
            self._moved.discard(handler.token)
            will_delay_at_least = self.moved_grace
        current = self.registrations.get(session.client_id)
        if handler.clean_disconnect and current is not None and current.token == handler.token:
            # It said DISCONNECT: its will is gone now, before this close awaits anything, so
            # that a reconnect whose registration runs meanwhile cannot take this connection
            # for a taken-over one that owes its will (mosquitto's 07-will-reconnect-1273.py
            # against a cluster: the will went out on a clean reconnect).
            current.will = None
        if isinstance(session, RemoteSession):
            session.detach()
            self.relay.drop(session.client_id, session.token)
        else:
            await self.unbind(handler, session)
        # The home holds the will and publishes it if owed, after the delay in force now
        # (a DISCONNECT may have changed the session expiry that bounds it).
        in_force = effective_will(handler.will, handler.conn.v5)
        delay = None if in_force is None else will_delay(in_force)
        handler.will = None
        expiry = expiry_at_close(handler.conn.v5, self.core.limits.persistent_session_expiry)
        if self.home(session.client_id) in (self.node_id, None):
            await self.unregister(session.client_id, handler.token, owed_will,
                                  "connection closed", None, will_delay_at_least, delay)
        else:
            # Not awaited: a home that is slow or dying must not hold the close up.  A new
            # connection of the id on this node waits for it (``open``).
            done = self._closing[session.client_id] = trio.Event()
            self.spawn(self._end_then_signal, done, session.client_id, handler.token,
                       owed_will, expiry, time.time(), will_delay_at_least, delay)

    async def _end_then_signal(self, done: trio.Event, client_id: str, token: str,
                               publish_will: bool, session_expiry: int | None,
                               closed_at: float, will_delay_at_least: float,
                               delay: int | None, abandoned: bool = False) -> None:
        try:
            await self._end_registration(client_id, token, publish_will, session_expiry,
                                         closed_at, will_delay_at_least, delay, abandoned)
        finally:
            done.set()
            if self._closing.get(client_id) is done:
                del self._closing[client_id]

    async def _end_registration(self, client_id: str, token: str, publish_will: bool,
                                session_expiry: int | None = None,
                                closed_at: float | None = None,
                                will_delay_at_least: float = 0.0,
                                delay: int | None = None, abandoned: bool = False) -> None:
        """End connection ``token``'s registration wherever the view puts its home, and
        know it ended: asked again by each newer view while the home does not answer (it
        may die with the close in flight; the replica taking over holds the registration
        then), bounded by ``patience`` after the last view change.  ``abandoned``: the
        connection was never accepted (``_abandon``)."""
        deadline = trio.current_time() + self.patience
        epoch = self.view().epoch
        while True:
            view = self.view()
            if view.epoch != epoch:
                epoch, deadline = view.epoch, trio.current_time() + self.patience
            home = self.home(client_id, view)
            if home is None or home == self.node_id:
                if not self._promotion_pending(client_id, token):
                    await self.unregister(client_id, token, publish_will, "connection closed",
                                          closed_at, will_delay_at_least, delay)
                    return
                if trio.current_time() >= deadline:
                    log.warning("close of %r: the registration was never promoted here",
                                client_id)
                    return
                await self.wait_for_view_change(0.1)
                continue
            try:
                await self.links.request(home, SessionClose(0, client_id, token, publish_will,
                                                            session_expiry, closed_at,
                                                            will_delay_at_least, delay,
                                                            abandoned))
                return
            except (PeerUnavailable, RemoteError) as exc:
                if trio.current_time() >= deadline:
                    log.warning("close of %r not confirmed by its home %s: %s", client_id,
                                home, exc)
                    return
                log.debug("close of %r at %s: %s; asking again", client_id, home, exc)
            await self.wait_for_view_change(0.5)

    async def persist(self, sessions: Iterable[Session], durability: Durability) -> None:
        local = []
        for session in sessions:
            if isinstance(session, RemoteSession):
                await self.relay.forward_changes(session, durability)
            else:
                local.append(session)
        if local:
            await super().persist(local, durability)

    def forward_subscribe(self, session: Session, packet_id: int,
                          topics: tuple[tuple[str, int], ...],
                          options: tuple[int, ...] | None = None,
                          subscription_id: int = 0) -> HomeAnswer | None:
        return self.relay.forward_subscribe(session, packet_id, topics, options,
                                            subscription_id)

    def forward_unsubscribe(self, session: Session, packet_id: int,
                            topics: tuple[str, ...]) -> HomeAnswer | None:
        return self.relay.forward_unsubscribe(session, packet_id, topics)

    def on_skick(self, node: str, message: SessionKick) -> None:
        self._kick_token(message.token, message.reason_code)
        self.links.reply(node, message.req, True)

    def _kick_token(self, token: str, reason_code: int = 0x8E) -> None:
        handler = self.by_token.pop(token, None)
        if handler is not None:
            if handler.client_id is not None:
                self.relay.drop(handler.client_id, token)
            handler.will = None  # the home publishes it
            # MQTT 5: "session taken over" (if it was accepted), or the home's reason
            handler.goodbye(reason_code)
            handler.kick("taken over by a new connection" if reason_code == 0x8E
                         else f"closed by its session's home (reason {reason_code:#x})")

    # -- home side (the registrations: ``mqttring.cluster.registrations``) -----------

    async def on_sopen(self, node: str, message: SessionOpen) -> None:
        """Register connection ``message.token``, bind its session and serve it to its
        edge, as one step under the id's lock: a takeover registered between the
        registration and the attachment found nothing attached to detach, and the
        connection it had just replaced attached the session afterwards, to a relay no
        connection read any more (a "ghost": never expired, queued past ``max_queued``,
        kept its shared-group turns; the probe of 2026-11-29 left one in 11 of 12 races of
        two CONNECTs at one edge).  A refusal once registered undoes it all
        (``end_unaccepted``): the edge refuses the client and will send no close."""
        req, client_id, edge, token, clean = (message.req, message.client_id, message.edge,
                                              message.token, message.clean)
        if self.fenced():
            self.links.reply(node, req, False, f"{self.node_id} is cut off from the majority")
            return
        if self.view().epoch == 0:
            # Restarting, and asked before our own join gave us a view (peers still see our
            # previous life as the home): we cannot know whose session this is yet.
            self.links.reply(node, req, False, f"{self.node_id} has no cluster view yet")
            return
        v5 = message.v5
        cut = v5.cut_expiry if v5 is not None else cut_expiry(
            None, self.core.limits.persistent_session_expiry)
        try:
            await self._await_loaded(client_id)
            async with self.id_lock(client_id):
                if self.was_abandoned(token):
                    raise SessionUnavailable("the connection closed before its session "
                                             "opened")
                try:
                    await self.register_locked(client_id, edge, token,
                                               will_from_wire(message.will), clean,
                                               v5 is not None and v5.clean_start,
                                               message.username)
                    session, present = await self.bind(
                        client_id, clean, v5 is not None and v5.clean_start,
                        v5 is not None and v5.until_close, cut)
                    if clean:
                        # The clean session itself lives at the edge: nothing stays here
                        # but the registration (the bind above discarded any stored one).
                        if self.core.sessions.get(client_id) is session:
                            del self.core.sessions[client_id]
                        self.links.reply(node, req, True, SessionOpened(False, [], []))
                        return
                    self.relay.serve(node, message, session, present)
                except BaseException:
                    await self.end_unaccepted(client_id, token, cut or None,
                                              "refused by its home mid-CONNECT")
                    raise
            await self.relay.settle(session)
        except (PeerUnavailable, RemoteError, SessionUnavailable, OSError) as exc:
            self.links.reply(node, req, False, str(exc))
        except Exception:
            self.links.reply(node, req, False, "internal error")  # never leave it waiting
            raise

    async def on_sclose(self, node: str, message: SessionClose) -> None:
        """End connection ``message.token``'s registration, under the id's lock: never
        between a ``sopen``'s registration and its attachment (``on_sopen``)."""
        client_id = message.client_id
        async with self.id_lock(client_id):
            if self.home(client_id) != self.node_id or self._promotion_pending(
                    client_id, message.token):
                self.links.reply(node, message.req, False,
                                 f"{self.node_id} is not (yet) the home of {client_id!r}")
                return
            current = await self.unregister(client_id, message.token, message.publish_will,
                                            "connection closed without DISCONNECT at its "
                                            "edge", message.closed_at,
                                            message.will_delay_at_least, message.will_delay)
            if not current and message.abandoned:
                self.note_abandoned(message.token)  # its sopen may come yet: refused
            self.links.reply(node, message.req, True)
            session = self.core.sessions.get(client_id)
            if current and message.session_expiry is not None and session is not None:
                # MQTT 5: the session's expiry runs here, at its home, by wall clock.
                await self.session_expiry_at_close(session, message.session_expiry)

    # -- membership changes -----------------------------------------------------------------

    async def on_view(self, old: ClusterView, new: ClusterView) -> None:
        """Wills of clients whose edge died; clients whose home moved or restarted reconnect."""
        await self._move_registrations(old, new)
        for handler in list(self.core.clients.values()):
            session = handler.session
            if session is None or handler.client_id is None:
                continue
            before, after = self.home(handler.client_id, old), self.home(handler.client_id, new)
            if before == after:
                if isinstance(session, RemoteSession) and home_restarted(old, new, after):
                    # Still its home, in a new life: the proxy it served went with the old
                    # one, and the new life holds the session offline; nothing would reach
                    # this connection again.  Reconnected as for a move.
                    self.kick_moved(handler, "its session's home restarted")
                continue
            if session.clean_session:
                # Re-register (same token: no takeover) so the new home holds the will.
                self.spawn(self._reregister, handler, after)
            else:
                # Its session moved; the client reconnects to the new home.
                self.kick_moved(handler)

    def kick_moved(self, handler: ClientHandler,
                   reason: str = "its session moved to another node",
                   reason_code: int = 0x89) -> None:
        """Disconnect a live client whose persistent session moved to another home, to
        reconnect to it there.  Its will waits ``moved_grace`` for it (a server-side
        will delay): it is alive, and a will published now told its watchers it was gone
        (the operator probe of 2026-11-28 counted such wills on every fault).
        ``reason_code``: MQTT 5, 0x89 server busy by default."""
        if handler.token and self.moved_grace > 0:
            self._moved.add(handler.token)
        handler.kick(reason, reason_code)

    def send_away(self, reason: str) -> int:
        """Disconnect every client of this node (it is leaving the cluster), as
        ``kick_moved`` does: each one reconnects to another node, and its will waits
        ``moved_grace`` for it there.  MQTT 5: 0x8B server shutting down.  Returns how many."""
        handlers = list(self.by_token.values())
        for handler in handlers:
            self.kick_moved(handler, reason, 0x8B)
        return len(handlers)

    async def _reregister(self, handler: ClientHandler, home: str | None) -> None:
        """Register a clean session's connection (and will) at its new home.

        Retried while the connection lives, bounded by ``patience``: the new home may
        still be loading its shard or not yet serving, and a will must not be lost to that.
        """
        deadline = trio.current_time() + self.patience
        access = handler.session.access if handler.session is not None else None
        username = access.username if access is not None else None
        while handler.client_id is not None and home is not None and not handler.finished:
            in_force = effective_will(handler.will, handler.conn.v5)
            will = will_to_wire(in_force)
            try:
                if home == self.node_id:
                    await self.register(handler.client_id, self.node_id, handler.token,
                                        in_force, True, username=username)
                else:
                    await self.links.request(home, SessionOpen(
                        0, handler.client_id, self.node_id, handler.token, True, will,
                        username))
                if handler.finished:
                    # The connection closed while the home was registering it; its close
                    # may have reached the home first and been ignored (nothing was
                    # registered yet).  End the registration now, or it would stay: a will
                    # published later for a client that said DISCONNECT.
                    await self._end_registration(handler.client_id, handler.token,
                                                 handler.owed_will)
                return
            except (PeerUnavailable, RemoteError, SessionUnavailable) as exc:
                if trio.current_time() >= deadline:
                    log.warning("could not re-register %r at %s: %s", handler.client_id,
                                home, exc)
                    return
                log.info("re-registering %r at %s: %s; retrying", handler.client_id, home, exc)
            await self.wait_for_view_change(0.5)
            home = self.home(handler.client_id)


__all__ = ["ClusterSessions", "Registration", "RemoteSession", "home_restarted"]
