"""Owner -> the nodes with subscribers: ``Dlv`` out, ``Delivered`` back, leftovers followed.

Theory of operation
-------------------
The owner of a topic's shard knows, per message, which nodes have matching subscribers and
which of their sessions (``NodeTargets``: the node's clean sessions, and the session shards
whose persistent sessions it holds).  ``Deliveries.deliver(node, items)`` hands one node a
whole batch of such messages in one ``Dlv`` request, in the order they were published, and
returns once that node accepted them all: its clean sessions have them queued, and the
copies for persistent sessions are stored on every replica of their shard (one group commit
per ``Dlv``).  The publisher's PUBACK/PUBREC waits for that.

What a delivery can leave over, and what happens to it (``_redeliver``):

* the link broke or the node did not answer: its clean sessions are owed the messages for
  as long as the node is in the view (they die with it, and owe nothing after);
* the node did not hold a session shard named for it (still loading, or moved away in
  flight: ``Delivered`` names it): the shard's sessions follow its owner in the newer view.

A *share* entry (``NodeTargets.share``) asks the node for ONE member of that share among
the sessions named (``mqttring.cluster.shared`` chose the node): what it cannot place is
returned as *declined* (no member there any more, only offline ones, or the node left the
view before it answered) for the dispatcher to try the next target, never dropped here.

Leftovers are retried as a batch, in order, after each view change (or a short wait), and
bounded by ``patience``: past it the publish is refused (no acknowledgement, the client
resends), never given up silently.

The receiving side (``on_dlv``) serves a whole ``Dlv`` synchronously, in order, in the
link's reader: so messages keep their order from the owner to every session, and a batch
wakes each subscriber's writer once.  Only the durable write and flow control (a congested
subscriber holds its publishers back: ``mqttring.broker.flow``) wait, in a task.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol

import trio

from mqttring.broker.refusals import PublishRefused
from mqttring.broker.router import LocalRouter
from mqttring.broker.shared import Placement
from mqttring.cluster.errors import (
    PeerUnavailable,
    RemoteError,
    peer_failures_unwrapped,
)
from mqttring.cluster.links import Links, in_frames
from mqttring.cluster.messages import Delivered, Dlv, DlvEntry
from mqttring.cluster.viewchanges import ViewChanges
from mqttring.protocol.message import Message
from mqttring.protocol.session import Session
from mqttring.protocol.session5 import PublishProps
from mqttring.raft.view import ClusterView

log = logging.getLogger("mqttring.cluster.delivery")


class NodeTargets(NamedTuple):
    """The sessions of one node a message goes to (what a ``DlvEntry`` names)."""

    #: The node's clean sessions subscribe (they live and die with it).
    clean: bool
    #: Session shards the node owns whose persistent sessions subscribe.
    shards: list[int]
    #: Set: ONE member of this share among the sessions above (``mqttring.cluster.shared``).
    share: str = ""
    #: A share's offline persistent member may take it (no member online anywhere).
    offline_ok: bool = False
    #: Non-zero: the dispatcher's token for a copy it tracks (``DlvEntry.track``).
    track: int = 0
    #: The node that records that tracked copy too (``DlvEntry.witness``).
    witness: str = ""


#: Node -> its targets, for one topic under one view.
ByNode = dict[str, NodeTargets]
#: One message and the sessions of one node it goes to.
Item = tuple[Message, NodeTargets]
#: What became of a share's item at the node asked (``Placement``: SERVED, or why not), and
#: how many members there could have taken it online (reported when SERVED).
ShareOutcome = tuple[Message, NodeTargets, Placement, int]


def message_size(message: Message) -> int:
    """About what a message takes in a link frame (payload, topic, framing, properties)."""
    props = message.props
    extra = 0 if props is None else len(props.raw) + len(props.origin) + 16
    return len(message.payload) + len(message.topic) + 32 + extra


def total_size(messages: Iterable[Message]) -> int:
    """``message_size`` summed, without a call per message for those without properties
    (every QoS 1 crossing sizes its whole batch)."""
    return sum([len(m.payload) + len(m.topic) + 32 if m.props is None else message_size(m)
                for m in messages])


def message_runs(messages: list[Message], budget: int) -> Iterable[list[Message]]:
    """``in_frames`` by ``message_size``: the whole list as one run when it fits, which a
    batch from one connection's window almost always does."""
    if total_size(messages) <= budget:
        return (messages,)
    return in_frames(messages, message_size, budget)


def item_runs(items: list[Item], budget: int) -> Iterable[list[Item]]:
    """``message_runs`` for (message, targets) items."""
    if total_size(m for m, _ in items) <= budget:
        return (items,)
    return in_frames(items, lambda item: message_size(item[0]), budget)


def resolve(targets: Iterable[str], view: ClusterView) -> ByNode:
    """Route targets to nodes: a node id means its clean sessions, ``s:N`` the persistent
    sessions of shard N, wherever N's owner is in ``view``."""
    clean: set[str] = set()
    shards: dict[str, list[int]] = {}
    for target in targets:
        if target.startswith("s:"):
            shard = int(target[2:])
            node = view.owner(shard)
            if node is not None:
                shards.setdefault(node, []).append(shard)
        else:
            clean.add(target)
    return {node: NodeTargets(node in clean, shards.get(node, []))
            for node in clean.union(shards)}


class Targets(Protocol):
    """Which sessions of this node a message is for: a ``NodeTargets`` when the node
    delivers to itself, the ``DlvEntry`` itself when a peer asked (the same fields)."""

    @property
    def clean(self) -> bool: ...
    @property
    def shards(self) -> list[int]: ...
    @property
    def share(self) -> str: ...
    @property
    def offline_ok(self) -> bool: ...
    @property
    def track(self) -> int: ...
    @property
    def witness(self) -> str: ...


class _Served(NamedTuple):
    """What serving a batch here left to do."""

    #: Sessions with copies to store durably (each once).
    to_persist: list[Session]
    #: Sessions left congested: the batch is accepted once they have room.
    congested: list[Session]
    #: The session shards whose sessions got copies (a handoff waits for their writes).
    shards: list[int]
    #: (index in the batch, the shards named for it that this node does not hold).
    unheld: list[tuple[int, list[int]]]
    #: (index in the batch, why) of the share entries not placed here.
    declined: list[tuple[int, int]]
    #: (index in the batch, members online) of the share entries placed here.
    online: list[tuple[int, int]]


class Deliveries:
    def __init__(
        self,
        node_id: str,
        local: LocalRouter,
        links: Links,
        view: Callable[[], ClusterView],
        persist: Callable[[list[Session]], Any],
        spawn: Callable[..., None],
        holds: Callable[[int], bool],
        view_changes: ViewChanges,
        *,
        patience: float,
        request_timeout: float,
    ) -> None:
        self.node_id = node_id
        self.local = local
        self.links = links
        self.view = view
        self._persist = persist
        self.spawn = spawn
        #: True once this node owns the shard *and* has its persistent sessions loaded.
        self.holds = holds
        self.view_changes = view_changes
        self.patience = patience
        self.request_timeout = request_timeout
        #: Bytes of messages one ``Dlv`` may carry (see ``in_frames``).
        self.frame_budget = links.max_frame // 2
        #: session shard -> deliveries being made durable here (``handed_off`` waits for 0).
        self._persisting: dict[int, int] = {}
        self._persisted = trio.Event()

    # -- sending ----------------------------------------------------------------------------

    async def deliver(self, node: str, items: list[Item]) -> list[ShareOutcome]:
        """Deliver ``items`` to the sessions they name on ``node``; return once accepted,
        with what became of the share items (the caller tries other members for those
        nobody there could take).

        The common case is one request (or a local call); leftovers go to ``_redeliver``.
        """
        outcomes: list[ShareOutcome] = []
        left, failure = await self._attempt(node, items, outcomes)
        if left:
            await self._redeliver(node, left, failure, outcomes)
        return outcomes

    async def _attempt(self, node: str, items: list[Item], outcomes: list[ShareOutcome]
                       ) -> tuple[list[Item], Exception | None]:
        """One delivery to ``node``: what it left over, and why if it failed outright;
        what became of its share items is added to ``outcomes``."""
        if node == self.node_id:
            return await self._deliver_here(items, outcomes), None
        left: list[Item] = []
        done = 0
        for run in item_runs(items, self.frame_budget):
            entries = [DlvEntry(m.topic, m.payload, m.qos, t.shards, t.clean, t.share,
                                t.offline_ok, t.track,
                                props=None if m.props is None else m.props.to_wire(),
                                retain=m.retain, witness=t.witness, mid=m.mid)
                       for m, t in run]
            try:
                answer = await self.links.request(node, Dlv(0, entries), self.request_timeout,
                                                  expect=Delivered)
                for index, shards in answer.unheld:
                    if not 0 <= index < len(run):
                        raise RemoteError(f"{node} answered a Dlv of {len(run)} messages "
                                          f"about message {index}")
                    message, targets = run[index]
                    left.append((message, targets._replace(clean=False, shards=shards)))
                for index, why in answer.declined:
                    if not 0 <= index < len(run) or not run[index][1].share:
                        raise RemoteError(f"{node} declined entry {index} of a Dlv of "
                                          f"{len(run)} that it was not asked to choose for")
                    outcomes.append((*run[index], Placement(why), 0))
                for index, online in answer.online:
                    if 0 <= index < len(run) and run[index][1].share:
                        outcomes.append((*run[index], Placement.SERVED, online))
            except (PeerUnavailable, RemoteError, ValueError) as exc:
                return left + items[done:], exc
            done += len(run)
        return left, None

    async def _redeliver(self, node: str, items: list[Item], failure: Exception | None,
                         outcomes: list[ShareOutcome]) -> None:
        """What a first delivery to ``node`` left over, retried until it is accepted (see
        the module docstring), in order, as one batch per node and round."""
        deadline = trio.current_time() + self.patience
        with peer_failures_unwrapped():
            async with trio.open_nursery() as followers:
                while True:
                    await self.view_changes.wait(0.2 if failure is not None else 0.5)
                    view = self.view()
                    live = node in view.live_members()
                    stay: list[Item] = []
                    moved: dict[str, list[Item]] = {}
                    for message, item in items:
                        clean, shards = item.clean, item.shards
                        if clean and not live:
                            clean = False  # its clean sessions died with it
                            if item.share:  # ... but the share has other members
                                outcomes.append((message, item, Placement.NODE_GONE, 0))
                                continue
                        if shards:
                            by_node = resolve((f"s:{s}" for s in shards), view)
                            here = by_node.pop(node, None)
                            shards = here.shards if here is not None else []
                            for other, targets in by_node.items():
                                moved.setdefault(other, []).append(
                                    (message, item._replace(clean=False,
                                                            shards=targets.shards)))
                        if clean or shards:
                            stay.append((message, item._replace(clean=clean, shards=shards)))
                    if not live and any(t.clean for _, t in items):
                        log.info("delivery of %d messages to %s not confirmed (%s); it left "
                                 "the view", len(items), node, failure)
                    for other, followed in moved.items():
                        followers.start_soon(self._follow, other, followed, outcomes)
                    if not stay:
                        return
                    if trio.current_time() >= deadline:
                        raise PeerUnavailable(
                            f"delivery of {len(stay)} messages (first {stay[0][0].topic!r}) "
                            f"to {node} not confirmed within {self.patience}s: {failure}")
                    items, failure = await self._attempt(node, stay, outcomes)
                    if not items:
                        return

    async def _follow(self, node: str, items: list[Item], outcomes: list[ShareOutcome]) -> None:
        outcomes.extend(await self.deliver(node, items))

    # -- receiving --------------------------------------------------------------------------

    def _serve(self, batch: Iterable[tuple[Message, Targets]],
               sender: str | None = None) -> _Served:
        """Deliver a batch to this node's sessions, in order, without yielding."""
        holds = self.holds
        deliver_local = self.local.deliver_local
        to_persist: dict[int, Session] = {}  # by id: one write per session (unhashable)
        congested: list[Session] = []
        shards_served: set[int] = set()
        unheld: list[tuple[int, list[int]]] = []
        declined: list[tuple[int, int]] = []
        online: list[tuple[int, int]] = []
        with self.local.wakes_deferred():
            for index, (message, targets) in enumerate(batch):
                clean, shards, share = targets.clean, targets.shards, targets.share
                held = shards
                if shards and not all(holds(s) for s in shards):
                    # Still loading here, or gone (the view moved it in flight): serve the
                    # rest now, name the shard so the sender finds its sessions where they are.
                    held = [s for s in shards if holds(s)]
                    unheld.append((index, [s for s in shards if not holds(s)]))
                if share:
                    if not (clean or held):
                        continue  # the sender follows the unheld shard
                    track = targets.track
                    placed, session, ready = self.local.deliver_to_share(
                        message, share, clean=clean, shards=held,
                        offline_ok=targets.offline_ok, congested=congested,
                        origin=(sender, track, targets.witness)
                        if track and sender is not None else None)
                    if placed is not Placement.SERVED:
                        declined.append((index, int(placed)))
                        continue
                    online.append((index, ready))
                    if session is not None and session.persistent and message.qos:
                        to_persist[id(session)] = session
                        shards_served.update(held)
                elif clean or held:
                    for session in deliver_local(message, clean=clean, shards=held,
                                                 congested=congested):
                        to_persist[id(session)] = session
                    if held:
                        shards_served.update(held)
        return _Served(list(to_persist.values()), congested, sorted(shards_served), unheld,
                       declined, online)

    async def _deliver_here(self, items: list[Item], outcomes: list[ShareOutcome]
                            ) -> list[Item]:
        """``deliver`` to this node itself; returns the items' shards it does not hold."""
        served = self._serve(items, self.node_id)
        outcomes.extend((*items[i], Placement(why), 0) for i, why in served.declined)
        outcomes.extend((*items[i], Placement.SERVED, n) for i, n in served.online)
        if served.to_persist:
            await self._persist_tracked(served.to_persist, served.shards)
        if served.congested:
            await self.local.hold_back(served.congested)
        return [(items[i][0], items[i][1]._replace(clean=False, shards=shards))
                for i, shards in served.unheld]

    def on_dlv(self, node: str, msg: Dlv) -> None:
        """Serve a ``Dlv`` now (in the link's reader: order kept); answer once stored."""
        served = self._serve([(Message(e.topic, e.payload, e.qos, e.retain,
                                       PublishProps.from_wire(e.props), e.mid), e)
                              for e in msg.entries], node)
        req = msg.req
        if req == 0:
            return
        answer = Delivered(served.unheld, served.declined, served.online)
        if not served.to_persist and not served.congested:
            self.links.reply(node, req, True, answer)
            return

        async def persist_then_ack() -> None:
            try:
                if served.to_persist:
                    await self._persist_tracked(served.to_persist, served.shards)
            except PublishRefused as exc:
                # Not durable on every replica (a peer failed, or the write that carried
                # these changes was cancelled): the sender must not count it accepted.
                self.links.reply(node, req, False, str(exc))
                return
            if served.congested:
                await self.local.hold_back(served.congested)  # flow control: publishers wait
            self.links.reply(node, req, True, answer)

        self.spawn(persist_then_ack)

    # -- handoffs ---------------------------------------------------------------------------

    async def _persist_tracked(self, sessions: list[Session], shards: list[int]) -> None:
        """Make deliveries durable, counted per session shard so that a handoff of that
        shard can wait until none is in flight (``handed_off``)."""
        persisting = self._persisting
        for shard in shards:
            persisting[shard] = persisting.get(shard, 0) + 1
        try:
            await self._persist(sessions)
        finally:
            for shard in shards:
                left = persisting[shard] - 1
                if left:
                    persisting[shard] = left
                else:
                    del persisting[shard]
            event, self._persisted = self._persisted, trio.Event()
            event.set()

    async def handed_off(self, shards: list[int], epoch: int, timeout: float) -> bool:
        """Wait until this node's view is at ``epoch`` or later (so it no longer takes
        deliveries for ``shards``) and none of its deliveries to them is still being
        written; the new home loads the shards' sessions only then, so nothing this node
        queued for them is missing from what it loads."""
        started = trio.current_time()
        with trio.move_on_after(timeout):
            while self.view().epoch < epoch:
                await self.view_changes.wait(0.2)
            viewed = trio.current_time()
            while any(s in self._persisting for s in shards):
                await self._persisted.wait()
            log.debug("handoff of %d shards: view after %.3fs, writes after %.3fs",
                      len(shards), viewed - started, trio.current_time() - started)
            return True
        return False
