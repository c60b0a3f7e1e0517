"""Shared subscriptions across the cluster: the owner picks one member per share and message.

Theory of operation
-------------------
A share's members may sit on any nodes.  Each registers its membership like any route:
``($share/g/f, target)``, where the target is its node (a clean session) or ``s:N`` (a
persistent session of client shard N, living at N's owner), placed by the inner filter
(``mqttring.cluster.routes``).  So the owner of a topic's shard knows, for every share
matching the topic, the *targets* that have members, though not the members themselves.

Per message and matching share, the owner (``ShareAttempt``, sans-IO):

1. orders the share's targets by the strategy (``round_robin``: the rotation of the
   ``Chooser``, per share, a target having as many turns as its node last said it has
   members online, so each member gets an even share; ``random``, weighted alike;
   ``local_first``: targets on this node first), and
   asks the first target's node (a ``Dlv`` entry naming the share) to give the message to
   ONE of its members there, online ones first;
2. if that node has no member left (it unsubscribed or ended in flight: ``NO_MEMBER``), only
   offline persistent ones (``OFFLINE_ONLY``), or left the view before it answered
   (``NODE_GONE``), asks the next target: nothing is dropped for a race (but a copy
   tracked for that node, below, that ``on_view`` already took back is placed by it alone);
3. when every target declined and some had offline members, asks those again with
   ``offline_ok`` (the first that still has one queues it): an offline persistent member
   gets a message only when no member is online anywhere;
4. when no target is left, the share has no member: the message is not delivered to it, as
   for a topic without subscribers.

The owner's acknowledgement to the publisher (QoS >= 1) waits for that, so an acknowledged
message is queued at exactly one member of each share (at least one, if a redispatch below
happened after the member had it).

After that, what a member holds unacknowledged goes back to the share when its session ends
(clean session closed, or discarded by a clean start): its node sends those copies to the
topic's owner (``Redispatch``), which runs the same steps for that share alone.  Persistent
members keep what they were sent across a disconnect (they get it on reconnect).  A QoS 2
copy whose PUBREC came is not sent again.  So each message reaches at least one member, and
exactly one as long as no member ends with it unacknowledged.

A member's node may also die with copies queued or in flight at its clean members.  So the
owner keeps each copy it places with a clean member on another node (``unconfirmed``, by a
token carried in the ``DlvEntry``) until that node reports it gone (``SharedDone``: the
client acknowledged it, or it was handed back as above; ``CopyWatch`` notices on the member's
node); when the node leaves the view, what it had not reported goes to other members
(``on_view``), at least once.  Copies for persistent members need none of this: they are
stored at the session's home and its replicas.  The owner's record dies with the owner, so
each tracked copy (a clean member on any node, the owner's own included) is also recorded,
before the publisher is acknowledged, at a witness node that is neither the owner nor the
member's node; the witness places it again if the owner and the member's node both leave
the view (``mqttring.cluster.witness``).  Two failures at once are covered, not three.

QoS 0 goes the same way in a task of its own, so a plain publish never waits for it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import trio

from mqttring.broker.metrics import BrokerMetrics
from mqttring.broker.shared import Chooser, CopyWatch, Placement, SharedMessage, Strategy
from mqttring.cluster.delivery import Item, NodeTargets, ShareOutcome, message_size
from mqttring.cluster.errors import PeerUnavailable, RemoteError, peer_failures_unwrapped
from mqttring.cluster.links import Links, in_frames
from mqttring.cluster.messages import (
    Redispatch,
    SharedDone,
    SharedEntry,
    ShareTrack,
    TrackedEntry,
)
from mqttring.cluster.viewchanges import ViewChanges
from mqttring.cluster.witness import OwnCopies, WitnessBook, choose_witness
from mqttring.protocol.message import Message
from mqttring.protocol.session5 import PublishProps, props_to_wire
from mqttring.raft.view import ClusterView

log = logging.getLogger("mqttring.cluster.shared")

__all__ = ["ShareAttempt", "ShareDispatch", "target_node"]


def target_node(target: str, view: ClusterView) -> tuple[str | None, NodeTargets]:
    """The node a route target lives on under ``view``, and which of its sessions."""
    if target.startswith("s:"):
        shard = int(target[2:])
        return view.owner(shard), NodeTargets(False, [shard])
    return target, NodeTargets(True, [])


class ShareAttempt:
    """One message on its way to one member of one share: the targets still to ask."""

    __slots__ = ("message", "offline", "offline_phase", "pending", "share", "tried")

    def __init__(self, message: Message, share: str, order: list[str]) -> None:
        self.message = message
        self.share = share
        #: Targets not yet asked, next first.
        self.pending = order
        #: Targets that had only offline members (asked again with ``offline_ok``).
        self.offline: list[str] = []
        self.offline_phase = False
        #: The target asked last (whose answer is awaited).
        self.tried: str | None = None

    def next(self, view: ClusterView) -> tuple[str, Item] | None:
        """The next node to ask and what; None when no target is left."""
        while True:
            if not self.pending:
                if self.offline_phase or not self.offline:
                    return None
                self.offline_phase, self.pending, self.offline = True, self.offline, []
            target = self.pending.pop(0)
            node, targets = target_node(target, view)
            if node is None or node not in view.live_members():
                continue
            self.tried = target
            return node, (self.message, targets._replace(share=self.share,
                                                         offline_ok=self.offline_phase))

    def declined(self, why: Placement) -> None:
        """The node asked last could not place it."""
        if why is Placement.OFFLINE_ONLY and not self.offline_phase and self.tried:
            self.offline.append(self.tried)


class ShareDispatch:
    """Builds the attempts for messages (the decisions above), and runs them.

    ``shares_for(topic)`` gives share -> targets from the route table, ``deliver(node,
    items)`` is ``Deliveries.deliver`` (it returns what became of each share item).
    """

    def __init__(self, node_id: str, strategy: Strategy,
                 shares_for: Callable[[str], dict[str, list[str]]],
                 deliver: Callable[[str, list[Item]], Awaitable[list[ShareOutcome]]],
                 view: Callable[[], ClusterView], links: Links, view_changes: ViewChanges,
                 copies: CopyWatch, metrics: BrokerMetrics, *, patience: float,
                 request_timeout: float) -> None:
        self.node_id = node_id
        self.strategy = strategy
        #: The rotation over targets (members of a node rotate in ``LocalRouter``'s own).
        self.chooser = Chooser(strategy)
        self.shares_for = shares_for
        self._deliver = deliver
        self.view = view
        self.links = links
        self.view_changes = view_changes
        self.patience = patience
        self.request_timeout = request_timeout
        #: Copies this node placed here for dispatchers elsewhere (``CopyWatch``).
        self.copies = copies
        #: node -> token -> (message, share): copies placed with clean members there and
        #: not yet reported gone; placed again if that node leaves the view first.
        self.unconfirmed: dict[str, dict[int, tuple[Message, str]]] = {}
        #: Tokens unique across this node's restarts (a witness may still hold records of
        #: its former life): they start at the clock, in microseconds.
        self._tokens = itertools.count(time.time_ns() // 1000)
        #: Copies placed with clean members here, each recorded at a witness too.
        self.own = OwnCopies()
        #: Other owners' records of copies with clean members (we are their witness).
        self.witnessed = WitnessBook()
        #: id(copy being placed again because its member's node left) -> (its witness, its
        #: token): the witness is told to forget it once it is placed.
        self._placing: dict[int, tuple[str, int]] = {}
        #: Tokens of tracked copies in a ``Dlv`` not answered yet (``_ask``), and those of
        #: them that ``on_view`` took back from a node that left: ``on_view`` places those
        #: again itself, so their ``Dlv``'s failure (``NODE_GONE``) is no decline, or each
        #: was placed twice (a probe killed a member's node mid-stream: 1 to 16 QoS 1
        #: duplicates per run).  Both hold only copies in flight.
        self._asking: set[int] = set()
        self._taken_back: set[int] = set()
        #: (share, target) -> members online there when last asked: a target's turns in
        #: the rotation, so that each member, not each node, gets an even share.
        self.weights: dict[tuple[str, str], int] = {}
        #: Redispatched copies and copies no longer tracked (``MAX_UNCONFIRMED``) are
        #: counted here (``$SYS``, ``/metrics``); placements and declines by the node asked.
        self.metrics = metrics

    def attempts(self, messages: Sequence[Message], view: ClusterView) -> list[ShareAttempt]:
        """One attempt per message and matching share (a ``SharedMessage`` being
        redispatched: its own share only), targets in the strategy's order."""
        found: list[ShareAttempt] = []
        for message in messages:
            shares = self.shares_for(message.topic)
            if not shares:
                continue
            only = message.share if type(message) is SharedMessage else None
            for share, targets in shares.items():
                if only is not None and share != only:
                    continue
                found.append(ShareAttempt(message, share, self.order(share, targets, view)))
        return found

    #: Weights kept (cleared when full: targets fall back to one turn until asked again).
    MAX_WEIGHTS = 100_000

    def order(self, share: str, targets: list[str], view: ClusterView) -> list[str]:
        """The targets in the order to ask them.  A target with k members online (as its
        node last said) has k turns in the rotation, so members on a crowded node get as
        many messages as one alone on another; each target is asked once per message."""
        weights = self.weights
        if weights:
            turns = [t for t in targets for _ in range(weights.get((share, t), 1) or 1)]
            if len(turns) != len(targets):
                ordered = list(dict.fromkeys(self.chooser.order(share, turns)))
            else:
                ordered = self.chooser.order(share, targets)
        else:
            ordered = self.chooser.order(share, targets)
        if self.strategy is Strategy.LOCAL_FIRST:
            me = self.node_id
            here = [t for t in ordered if target_node(t, view)[0] == me]
            if here:
                ordered = here + [t for t in ordered if t not in here]
        return ordered

    async def run(self, messages: Sequence[Message]) -> None:
        """Place every message with one member of each matching share; return once each is
        placed or its share has no member left.  Each round asks every node once (one
        ``Dlv`` per node, the messages in order), then the declined go to their next
        target."""
        view = self.view()
        pending = self.attempts(messages, view)
        while pending:
            by_node: dict[str, list[tuple[ShareAttempt, Item]]] = {}
            to_witness: dict[tuple[str, str], list[TrackedEntry]] = {}
            for attempt in pending:
                step = attempt.next(view)
                if step is None:
                    log.debug("%r: no member of %s left", attempt.message.topic, attempt.share)
                    continue
                node, item = step
                if item[1].clean and attempt.message.qos:
                    item = self._track(node, attempt, item, view, to_witness)
                by_node.setdefault(node, []).append((attempt, item))
            declined: dict[tuple[int, str], Placement] = {}
            attempts_of: dict[tuple[int, str], ShareAttempt] = {}
            if to_witness:  # recorded at the witness before the publisher is acknowledged
                with peer_failures_unwrapped():
                    async with trio.open_nursery() as nursery:
                        for (witness, member), entries in to_witness.items():
                            nursery.start_soon(self._record, witness, member, entries)
                        for node, asked in by_node.items():
                            nursery.start_soon(self._ask, node, asked, declined, attempts_of)
            elif len(by_node) == 1:
                [(node, asked)] = by_node.items()
                await self._ask(node, asked, declined, attempts_of)
            elif by_node:
                with peer_failures_unwrapped():
                    async with trio.open_nursery() as nursery:
                        for node, asked in by_node.items():
                            nursery.start_soon(self._ask, node, asked, declined, attempts_of)
            pending = []
            for key, why in declined.items():
                attempt = attempts_of[key]
                attempt.declined(why)
                pending.append(attempt)
            if pending:
                view = self.view()

    async def _ask(self, node: str, asked: list[tuple[ShareAttempt, Item]],
                   declined: dict[tuple[int, str], Placement],
                   attempts_of: dict[tuple[int, str], ShareAttempt]) -> None:
        """Ask ``node`` to place ``asked``; what it could not place goes to ``declined``.

        A tracked copy that ``on_view`` took back while its ``Dlv`` was in flight (``node``
        left the view) is not declined whatever the answer: ``on_view`` hands it to
        ``redispatch``, which places it once more (its witness keeps it until then), and
        asking the next target as well placed it twice.
        """
        for attempt, _ in asked:
            attempts_of[(id(attempt.message), attempt.share)] = attempt
        tracks = [item[1].track for _, item in asked if item[1].track]
        asking, taken_back = self._asking, self._taken_back
        asking.update(tracks)
        try:
            outcomes = await self._deliver(node, [i for _, i in asked])
            # (No checkpoint from here on: ``on_view`` cannot run in between.)
            for message, targets, why, online in outcomes:
                key = (id(message), targets.share)
                if why is Placement.SERVED:
                    attempt = attempts_of.get(key)
                    if attempt is not None and attempt.tried is not None:
                        if len(self.weights) >= self.MAX_WEIGHTS:
                            self.weights.clear()
                        self.weights[(targets.share, attempt.tried)] = online
                    continue
                if targets.track and targets.track in taken_back:
                    continue  # being placed again by ``on_view``'s redispatch
                declined[key] = why
                if targets.track:  # nobody holds it: its witness forgets it
                    self.unconfirmed.get(node, {}).pop(targets.track, None)
                    self._tell_witnesses(self.own.gone((targets.track,), told=False))
        finally:
            asking.difference_update(tracks)
            taken_back.difference_update(tracks)

    # -- copies placed on other nodes, until they are gone ----------------------------------

    #: Copies tracked per node; past it the oldest are forgotten (and counted).
    MAX_UNCONFIRMED = 100_000
    #: Seconds between the batches of ``SharedDone`` this node sends.
    DONE_INTERVAL = 0.1

    def _track(self, node: str, attempt: ShareAttempt, item: Item, view: ClusterView,
               to_witness: dict[tuple[str, str], list[TrackedEntry]]) -> Item:
        """A copy for a clean member on ``node``: kept until reported gone (to place it
        again if ``node`` dies first) and recorded at a witness (added to ``to_witness``),
        so that it is placed again too if this node dies, alone or with ``node``."""
        message = attempt.message
        token = next(self._tokens)
        me = self.node_id
        if node != me:  # our own node's members die with us: the witness covers them
            tracked = self.unconfirmed.setdefault(node, {})
            if len(tracked) >= self.MAX_UNCONFIRMED:
                del tracked[next(iter(tracked))]
                self.metrics.shared_untracked += 1
            tracked[token] = (message, attempt.share)
        witness = choose_witness(view, view.shard_for_topic(message.topic), (me, node))
        self.metrics.shared_untracked += self.own.add(
            token, SharedMessage(message, attempt.share), witness, node, node != me)
        if witness is None:
            return item[0], item[1]._replace(track=token)
        to_witness.setdefault((witness, node), []).append(TrackedEntry(
            token, message.topic, message.payload, message.qos, attempt.share,
            props_to_wire(message.props)))
        return item[0], item[1]._replace(track=token, witness=witness if node != me else "")

    #: Witnesses tried in turn for one round's records before giving up (then the records
    #: wait for the next view change, ``OwnCopies.rewitness``).
    WITNESS_TRIES = 3

    async def _record(self, witness: str, member: str, entries: list[TrackedEntry]) -> None:
        """Record ``entries`` (copies with members on ``member``) at ``witness``, or at the
        next candidate if it fails to answer."""
        tried: list[str] = [self.node_id, member]
        candidate: str | None = witness
        while candidate is not None and len(tried) < 2 + self.WITNESS_TRIES:
            try:
                await self.links.request(candidate, ShareTrack(0, member, entries),
                                         self.request_timeout)
            except (PeerUnavailable, RemoteError) as exc:
                log.info("witness %s did not record %d copies (%s)", candidate,
                         len(entries), exc)
                tried.append(candidate)
                view = self.view()
                candidate = choose_witness(view, view.shard_for_topic(entries[0].topic),
                                           tried)
                continue
            if candidate != witness:
                self.own.moved((e.token for e in entries), candidate)
            return
        log.warning("no witness recorded %d copies of shares (first %r): they are lost if "
                    "this node dies before the next view change", len(entries),
                    entries[0].topic)
        self.own.moved((e.token for e in entries), None)

    def _tell_witnesses(self, tell: dict[str, list[int]]) -> None:
        for witness, tokens in tell.items():
            self.links.send_control(witness, SharedDone(tokens, self.node_id))

    def on_track(self, node: str, msg: ShareTrack) -> None:
        """We are ``node``'s witness for these copies: record them, then answer."""
        copies = ((e.token, SharedMessage(Message(e.topic, e.payload, e.qos, False,
                                                  PublishProps.from_wire(e.props)), e.share))
                  for e in msg.entries)
        self.metrics.shared_untracked += self.witnessed.track(node, msg.member, copies)
        self.links.reply(node, msg.req, True)

    def on_done(self, node: str, msg: SharedDone) -> None:
        """``node`` let go of copies we placed there: nothing to place again for them (or,
        with ``origin`` set, of ``origin``'s copies we witness)."""
        if msg.origin:
            self.witnessed.done(msg.origin, msg.tokens)
            return
        tracked = self.unconfirmed.get(node)
        if tracked is not None:
            for token in msg.tokens:
                tracked.pop(token, None)
        # The member told the witness it was given; one we moved the record to since, we tell.
        self._tell_witnesses(self.own.gone(msg.tokens, told=True))

    def on_view(self, view: ClusterView) -> list[SharedMessage]:
        """The copies held at nodes that left the view, with their clean members: they go
        to other members of their shares (``redispatch``; at least once: a member may have
        had one without its acknowledgement reaching us)."""
        live = view.live_members()
        lost: list[SharedMessage] = []
        for node in [n for n in self.unconfirmed if n not in live]:
            for token, (message, share) in self.unconfirmed.pop(node).items():
                copy = SharedMessage(message, share)
                lost.append(copy)
                if token in self._asking:  # its ``Dlv`` is in flight: ``_ask`` lets it be
                    self._taken_back.add(token)
                # Its witness keeps it until it is placed again (we may die meanwhile).
                for witness in self.own.gone((token,), told=False):
                    if len(self._placing) < self.MAX_UNCONFIRMED:
                        self._placing[id(copy)] = (witness, token)
        dropped = self.witnessed.dropped
        lost.extend(self.witnessed.lost(view))
        self.metrics.shared_untracked += self.witnessed.dropped - dropped
        budget = self.links.max_frame // 2
        for (witness, member), records in self.own.rewitness(view, self.node_id).items():
            for run in in_frames(records, lambda record: message_size(record[1]), budget):
                self.links.send_control(witness, ShareTrack(0, member, [
                    TrackedEntry(token, c.topic, c.payload, c.qos, c.share,
                                 props_to_wire(c.props)) for token, c in run]))
        if lost:
            log.info("%d copies of shares were held at nodes that left the view; placing "
                     "them again", len(lost))
        return lost

    async def report_gone(self) -> None:
        """Forever: tell each dispatcher which of its copies here are gone (batched)."""
        while True:
            await trio.sleep(self.DONE_INTERVAL)
            self.send_gone()

    def send_gone(self) -> None:
        """One batch of ``report_gone``: to each dispatcher the tokens of its copies gone
        here; our own copies' tokens to their witnesses.  These, and the tracking of copies
        (``ShareTrack``), are never dropped at a full link: a witness that missed a copy's
        end places it again when its member's node dies (a second delivery), and one that
        missed a copy does not (an acknowledged message lost)."""
        for node, tokens in self.copies.take().items():
            if node == self.node_id:
                self._tell_witnesses(self.own.gone(tokens, told=False))
            else:
                self.links.send_control(node, SharedDone(tokens))
        for (witness, origin), tokens in self.copies.take_witnessed().items():
            self.links.send_control(witness, SharedDone(tokens, origin))

    # -- a member ended with copies unacknowledged ------------------------------------------

    async def redispatch(self, messages: Sequence[SharedMessage]) -> None:
        """Give each copy to another member of its share: here for the topics this node
        owns, through their owner (``Redispatch``) for the others, following view changes
        for as long as ``patience`` (an owner that died is replaced within it)."""
        self.metrics.shared_redispatched += len(messages)
        placed = await self._place_again(messages)
        tell: dict[str, list[int]] = {}
        for message in messages:
            record = self._placing.pop(id(message), None)
            if record is not None and placed:
                tell.setdefault(record[0], []).append(record[1])
        self._tell_witnesses(tell)

    async def _place_again(self, messages: Sequence[SharedMessage]) -> bool:
        """Place each with a member of its share (through the topic's owner); False if some
        were not placed within ``patience``."""
        deadline = trio.current_time() + self.patience
        while messages:
            view = self.view()
            by_owner: dict[str | None, list[SharedMessage]] = {}
            for message in messages:
                owner = view.owner(view.shard_for_topic(message.topic))
                by_owner.setdefault(owner, []).append(message)
            failed: list[SharedMessage] = []
            for owner, owned in by_owner.items():
                if owner is None or owner == self.node_id:
                    await self.run(owned)
                    continue
                # In runs under the frame limit: a member's unacknowledged copies can add
                # up to more than a link frame, which the link would drop.
                for run in in_frames(owned, message_size, self.links.max_frame // 2):
                    entries = [SharedEntry(m.topic, m.payload, m.qos, m.share,
                                           props_to_wire(m.props)) for m in run]
                    try:
                        await self.links.request(owner, Redispatch(0, entries),
                                                 self.request_timeout)
                    except (PeerUnavailable, RemoteError) as exc:
                        log.info("redispatch of %d copies to %s failed (%s); retrying",
                                 len(run), owner, exc)
                        failed.extend(run)
            if failed and trio.current_time() >= deadline:
                log.warning("%d copies of shares not redispatched within %.0fs (first %r)",
                            len(failed), self.patience, failed[0].topic)
                return False
            messages = failed
            if failed:
                await self.view_changes.wait(0.5)
        return True

    async def on_redispatch(self, node: str, msg: Redispatch) -> None:
        """A peer's member ended: its copies to other members of their shares; answered
        once placed (what we no longer own goes on to the owner by our view)."""
        copies = [SharedMessage(Message(e.topic, e.payload, e.qos, False,
                                        PublishProps.from_wire(e.props)), e.share)
                  for e in msg.entries]
        await self._place_again(copies)  # counted where the member ended
        self.links.reply(node, msg.req, True)
