"""Persistent, authenticated, batched links between nodes, with request/response on top.

Theory of operation
-------------------
Every node keeps one *outbound* link to every other live member.  A link is a connection to
the peer's cluster port (the RPC server of ``mqttring.rpc``: HMAC challenge both ways,
so a peer without the cluster secret is refused and logged there) switched into the
``data.link`` stream kind.  Messages travel one way on it: A's messages to B go on A's link
to B, B's replies on B's link to A.  That keeps each link a plain FIFO with one writer task.

Messages are the typed structs of ``mqttring.cluster.messages``, and so are frames.

Batching: ``send`` appends a message (a small struct) to the link's queue and wakes its
writer, which sends everything queued as one frame; under load one write carries many
messages, when idle a lone message leaves at once (no timer).  Plain QoS 0 publishes are
packed even tighter: ``send_frames`` appends an encoded PUBLISH to the packed batch at the
queue's tail (see ``mqttring.cluster.wire``), so a burst of them is one link message.

Back-pressure: a queue holds at most ``max_queued`` messages (each packed PUBLISH counts).
``send`` of a message that may be lost (QoS 0 traffic) drops it when the queue is full and
counts the drop; ``send_wait`` (acknowledged traffic, control messages) waits for room
instead, which slows exactly the publishers that feed a slow peer.  A frame never exceeds
``max_frame`` (sized from the broker's packet limit): the writer splits a batch that would.

Requests: ``request(node, msg)`` sends a copy of ``msg`` with a fresh request id in its
``req`` field and waits for the matching ``Ack`` from that node.  When the peer leaves the
view, or its link breaks, or its link to us (which carries the answers) breaks, its pending
requests fail with ``PeerUnavailable`` so the caller can retry, or re-route by the newer
epoch, instead of waiting forever.

Reconnects and replay: frames are numbered per link session, applied once and in order
by the receiver, acknowledged by number on the same connection, and kept by the sender
until then (``cluster/replay.py``).  A writer that loses its connection reconnects with
backoff for as long as the peer is in the view and sends the unacknowledged frames again
first; what is queued meanwhile waits (bounded as above).  So a connection can be replaced
at will: one with frames unacknowledged for ``stall_timeout`` while TCP retransmits, or for
twice that with every byte delivered (the acknowledgements are what is lost), is replaced
(``StallJudge``; ``replaced`` in ``stats``) instead of waited out.  Requests in flight on a
connection that *broke* still fail at once (the peer may be dead: callers decide again by
the view); on a replaced one they wait, since their frames will be replayed.  Every
successful (re)connection is reported (``on_connected``) so that the router re-sends its
full route set to that peer.

Fencing: every frame carries the sender's incarnation and view epoch (``stamp``); the
receiving end (``cluster/inbound.py``) applies only what ``admit`` accepts, so a node that
was cut off and declared dead can never have applied, after the heal, what it queued or
decided meanwhile.

Protocol errors: a frame or an acknowledgement that does not decode, or a message whose
content fails its checks, raises ``PeerProtocolError``, counted per peer
(``protocol_errors``, in ``stats``), which closes that peer's link; the peer reconnects and
the node keeps running.
"""

from __future__ import annotations

import itertools
import logging
import ssl
from collections import deque
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar, overload

import msgspec
import trio

from mqttring.cluster import wire
from mqttring.cluster.errors import PeerProtocolError, PeerUnavailable, RemoteError
from mqttring.cluster.inbound import ACK_INTERVAL, Admit, LinkReceiver, MessageHandler
from mqttring.cluster.messages import Ack, Batch, LinkMessage, Reply, Request, encode_frame
from mqttring.cluster.replay import ACK, OutboundWindow, StallJudge
from mqttring.cluster.wire import MAX_BATCH_BYTES
from mqttring.rpc import MAX_FRAME, FramedStream, Peer, RpcClient
from mqttring.tcp_options import discard_unsent, send_state

log = logging.getLogger("mqttring.cluster.links")

STREAM_KIND = "data.link"
MAX_QUEUED = 50_000
MAX_BATCH = 2_000
#: Answers kept for peers we have no link to yet (a joining node asks before we know it).
MAX_EARLY_REPLIES = 10_000
RECONNECT_MIN = 0.05
RECONNECT_MAX = 2.0
#: Room in a frame around one maximal client payload (topic, framing, other messages).
FRAME_HEADROOM = 1024 * 1024
#: Bytes of frames a link keeps unacknowledged before it waits for acknowledgements
#: (at least two frames of the largest size are always allowed).
MAX_UNACKED_BYTES = 32 * 1024 * 1024
#: Default ``link_stall_timeout``: no acknowledgement for this long while TCP retransmits,
#: and the connection is replaced.
STALL_TIMEOUT = 3.0


def frame_limit(max_packet_size: int) -> int:
    """The link frame size that carries any PUBLISH the broker accepts from clients."""
    return max(MAX_FRAME, max_packet_size + FRAME_HEADROOM)


R = TypeVar("R", bound=Reply)
T = TypeVar("T")
#: (incarnation, epoch) of this node, stamped on every frame it sends.
Stamp = Callable[[], tuple[int, int]]


def in_frames(items: list[T], size: Callable[[T], int], budget: int) -> Iterator[list[T]]:
    """``items`` cut, in order, into runs of at most ``budget`` bytes (at least one item
    each), so that a batched request never outgrows a link frame: the link would drop a
    message too big for any frame, and the requester would wait for an answer that never
    comes.  ``budget`` is half the frame limit, which always holds one maximal PUBLISH."""
    run: list[T] = []
    used = 0
    for item in items:
        n = size(item)
        if run and used + n > budget:
            yield run
            run, used = [], 0
        run.append(item)
        used += n
    if run:
        yield run


def _always(node: str, incarnation: int, epoch: int) -> bool:
    return True


def _no_stamp() -> tuple[int, int]:
    return (0, 0)


def _ignore(node: str) -> None:
    return None


class _Pending:
    __slots__ = ("done", "node", "ok", "result")

    def __init__(self, node: str) -> None:
        self.node = node
        self.done = trio.Event()
        self.ok = False
        self.result: Reply | str | Exception | None = None


class Link:
    """The outbound half towards one peer: a queue and the task that drains it."""

    def __init__(self, owner: Links, node_id: str, address: str) -> None:
        self.owner = owner
        self.node_id = node_id
        self.address = address
        self.queue: deque[LinkMessage] = deque()
        #: Messages queued, counting each PUBLISH in a packed batch: the back-pressure bound.
        self.queued = 0
        self.wakeup = trio.Event()
        self.room = trio.Event()
        self.connected = False
        #: True from a failed or broken connection until the next successful one: requests
        #: then fail at once instead of waiting for an answer that cannot come.
        self.down = False
        self.closed = False
        self.sent_messages = 0
        self.sent_frames = 0
        self.sent_bytes = 0
        self.dropped = 0
        self.cancel_scope = trio.CancelScope()
        #: Cancels the current connection only (``Links.reset``); the link reconnects.
        self.connection_scope: trio.CancelScope | None = None
        #: Bumped when the queue is discarded (``Links.clear``).
        self.generation = 0
        #: Frames sent and not yet acknowledged, for replay (``cluster/replay.py``).
        self.window = OutboundWindow(owner.max_unacked_bytes)
        self.window_room = trio.Event()
        #: Set by the stall guard: the connection ends by replacement, not by a failure.
        self.replacing = False
        self.replaced = 0
        self.replayed = 0

    def push(self, message: LinkMessage) -> bool:
        if self.queued >= self.owner.max_queued:
            self.dropped += 1
            return False
        self.append(message)
        return True

    def append(self, message: LinkMessage) -> None:
        """Queue one message whatever the bound (callers decide about back-pressure)."""
        self.queue.append(message)
        self.queued += 1
        self.wakeup.set()

    def push_frames(self, section: int, topic: str, frames: bytes | memoryview,
                    count: int) -> bool:
        """Append ``count`` encoded QoS 0 PUBLISHes of ``topic`` to the packed batch at the
        tail (a new batch if the tail is another message or full)."""
        if self.queued >= self.owner.max_queued:
            self.dropped += count
            return False
        queue = self.queue
        last = queue[-1] if queue else None
        if type(last) is Batch and len(last.blob) < MAX_BATCH_BYTES:
            wire.append(last, section, topic, frames, count)
        else:
            queue.append(wire.new_batch(section, topic, frames, count))
        self.queued += count
        self.wakeup.set()
        return True

    async def push_wait(self, message: LinkMessage) -> None:
        while self.queued >= self.owner.max_queued:
            if self.closed:
                raise PeerUnavailable(self.node_id)
            await self.room.wait()
        self.append(message)

    async def run(self) -> None:
        with self.cancel_scope:
            delay = RECONNECT_MIN
            while not self.closed:
                try:
                    client = await RpcClient.connect(
                        self.address, self.owner.key, self.owner.node_id, tls=self.owner.tls
                    )
                    stream = await client.open_stream(
                        STREAM_KIND, {"node": self.owner.node_id,
                                      "session": self.window.session})
                except Exception as exc:  # refused, unreachable, handshake failed: retry
                    log.debug("link %s -> %s: connect failed: %s", self.owner.node_id,
                              self.node_id, exc)
                    self.down = True
                    self.owner.link_broken(self)
                    await trio.sleep(delay)
                    delay = min(delay * 2, RECONNECT_MAX)
                    continue
                delay = RECONNECT_MIN
                generation = self.generation
                self.connected, self.down = True, False
                self.owner.on_connected(self.node_id)
                self.replacing = False
                try:
                    async with trio.open_nursery() as nursery:
                        self.connection_scope = nursery.cancel_scope
                        nursery.start_soon(self._watch, stream, nursery.cancel_scope)
                        nursery.start_soon(self._guard, stream, nursery.cancel_scope)
                        await self._drain(stream)
                except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as group:
                    # The nursery wraps what its tasks raise in an ExceptionGroup: a broken
                    # connection must end this connection only, never the node.
                    log.info("link %s -> %s broke: %s", self.owner.node_id, self.node_id,
                             group.exceptions[0])
                finally:
                    self.connection_scope = None
                    self.connected = False
                    replaced = self.replacing and not self.closed
                    # A replaced connection's frames are replayed on the next one: requests
                    # may wait for it, as they would have waited on this one.
                    self.down = not replaced
                    if self.closed or self.generation != generation or replaced:
                        # The peer left the view, or this node's life ended, or the frames
                        # are replayed on the next connection: what still sits in the
                        # kernel's send buffer must not arrive (after a partition heals,
                        # say).  A plain close would go on retransmitting it; a reset
                        # discards it.
                        discard_unsent(stream.stream)
                    with trio.CancelScope(shield=True):
                        await trio.aclose_forcefully(stream.stream)
                if not replaced:
                    self.owner.link_broken(self)

    async def _watch(self, stream: FramedStream, scope: trio.CancelScope) -> None:
        """Read the peer's acknowledgements, the only thing it writes on our link; end of
        stream means it died or restarted.

        Without this a dead peer would only be noticed at the next failed write, and a
        request to it (a route registration a SUBACK waits for) would hang until the
        failure detector changed the view.
        """
        pending = bytearray()
        try:
            while chunk := await stream.stream.receive_some(4096):
                pending += chunk
                whole = len(pending) - len(pending) % ACK.size
                if whole:
                    (seq,) = ACK.unpack_from(pending, whole - ACK.size)  # cumulative
                    del pending[:whole]
                    self.window.on_ack(seq, trio.current_time())
                    self.window_room.set()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.info("link %s -> %s broke: %s", self.owner.node_id, self.node_id,
                     exc.__cause__ or exc)
        except PeerProtocolError as exc:
            self.owner._protocol_error(self.node_id, exc)
        else:
            log.info("link %s -> %s: peer closed the connection", self.owner.node_id,
                     self.node_id)
        scope.cancel()

    async def _guard(self, stream: FramedStream, scope: trio.CancelScope) -> None:
        """Replace the connection once ``StallJudge`` finds it stalled: a fresh connection
        starts with a fresh retransmission timer, where this one may be backing off for
        tens of seconds, or waiting on acknowledgements the peer's kernel keeps resending."""
        timeout = self.owner.stall_timeout
        judge = StallJudge(timeout)
        while True:
            await trio.sleep(timeout / 4)
            window = self.window
            stalled = window.stalled_for(trio.current_time())
            why = judge.why_stalled(stalled, send_state(stream.stream))
            if why is not None:
                log.warning("link %s -> %s: no acknowledgement for %.1f s (%s); replacing "
                            "the connection (%d frames to send again)", self.owner.node_id,
                            self.node_id, stalled, why, len(window))
                self.replaced += 1
                self.replacing = True
                scope.cancel()
                return

    async def _drain(self, stream: FramedStream) -> None:
        for payload in self.window.reconnected(trio.current_time()):
            await stream.send_packed(payload)
            self.replayed += 1
        queue = self.queue
        while True:
            while self.window.full():
                self.window_room = trio.Event()
                await self.window_room.wait()
            if not queue:
                self.wakeup = trio.Event()
                if not queue:
                    await self.wakeup.wait()
            batch = [queue.popleft() for _ in range(min(len(queue), MAX_BATCH))]
            seq = self.window.next_seq()
            payload = self._pack(batch, seq)
            if payload is None:
                continue
            # Packed batches count their PUBLISHes; the one at the tail of this frame is
            # closed now, so nothing is appended to it while it is being sent.
            n = sum(m.count if type(m) is Batch else 1 for m in batch)
            self.queued -= n
            if self.queued < self.owner.max_queued:
                self.room.set()
                self.room = trio.Event()
            # In the window before the write: a write cut short is sent again, whole, on
            # the next connection.
            self.window.sent(seq, payload, trio.current_time())
            await stream.send_packed(payload)
            self.sent_messages += n
            self.sent_frames += 1
            self.sent_bytes += len(payload)

    def _pack(self, batch: list[LinkMessage], seq: int) -> bytes | None:
        """``batch`` packed into one frame the peer accepts, or None if there is nothing left.

        Too big a frame (many large payloads) gives back its second half to the queue and
        packs the first; a single message too big for any frame (a payload beyond the
        cluster's frame limit) is dropped and counted rather than breaking the link for
        everything behind it.
        """
        limit = self.owner.max_frame
        incarnation, epoch = self.owner.stamp()
        while True:
            payload = encode_frame(incarnation, epoch, batch, seq)
            if len(payload) <= limit:
                return payload
            if len(batch) == 1:
                dropped = batch.pop()
                n = dropped.count if type(dropped) is Batch else 1
                self.queued -= n
                self.dropped += n
                log.warning("link %s -> %s: dropped a %s message of %d bytes (frame limit %d)",
                            self.owner.node_id, self.node_id, type(dropped).__name__,
                            len(payload), limit)
                return None
            half = len(batch) // 2
            self.queue.extendleft(reversed(batch[half:]))
            del batch[half:]


class Links:
    """All outbound links of this node and the dispatch of inbound ones."""

    def __init__(self, node_id: str, key: bytes, handler: MessageHandler,
                 max_queued: int = MAX_QUEUED, max_frame: int = MAX_FRAME, *,
                 stamp: Stamp = _no_stamp, admit: Admit = _always,
                 on_connected: Callable[[str], None] = _ignore,
                 tls: ssl.SSLContext | None = None,
                 stall_timeout: float = STALL_TIMEOUT,
                 ack_interval: float = ACK_INTERVAL,
                 max_unacked_bytes: int = MAX_UNACKED_BYTES) -> None:
        self.node_id = node_id
        #: Client context of cluster TLS for the links this node opens (None: plain TCP).
        self.tls = tls
        self.stamp = stamp
        self.stall_timeout = stall_timeout
        self.max_unacked_bytes = max(max_unacked_bytes, 2 * max_frame)
        #: Called with the peer's id each time its link (re)connects.
        self.on_connected = on_connected
        #: Per peer: frames or messages it sent that we could not read (``PeerProtocolError``;
        #: each closed its link).
        self.protocol_errors: dict[str, int] = {}
        self.key = key
        self.max_queued = max_queued
        #: Frame size limit both ways; nodes of one cluster must agree (same limits).
        self.max_frame = max_frame
        self._links: dict[str, Link] = {}
        #: The receiving end: every peer's link to this node.
        self.receiver = LinkReceiver(handler, admit, max_frame=max_frame,
                                     ack_interval=ack_interval,
                                     on_answer=self._on_ack, on_lost=self._fail_pending,
                                     on_protocol_error=self._protocol_error)
        self._pending: dict[int, _Pending] = {}
        #: Answers to peers we have no link to yet (see ``reply``), per peer.
        self._early_replies: dict[str, list[LinkMessage]] = {}
        self._ids = itertools.count(1)
        self._nursery: trio.Nursery | None = None

    @property
    def refused_frames(self) -> int:
        """Frames from fenced-off senders, never applied (``LinkReceiver``)."""
        return self.receiver.refused_frames

    @property
    def received_messages(self) -> int:
        return self.receiver.received_messages

    async def serve_stream(self, stream: FramedStream, peer: Peer, body: dict[str, Any]) -> None:
        """RPC stream handler for ``data.link`` (``LinkReceiver.serve_stream``)."""
        await self.receiver.serve_stream(stream, peer, body)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    # -- membership ---------------------------------------------------------------------

    def update_peers(self, peers: dict[str, str]) -> None:
        """Open links to new peers (node id -> cluster address) and close the others."""
        assert self._nursery is not None
        for node_id, link in list(self._links.items()):
            if peers.get(node_id) != link.address:
                self._close(link)
        for node_id, address in peers.items():
            if node_id != self.node_id and node_id not in self._links:
                link = Link(self, node_id, address)
                self._links[node_id] = link
                for answer in self._early_replies.pop(node_id, ()):
                    link.append(answer)
                self._nursery.start_soon(link.run)
        for node_id in [n for n in self._early_replies if n not in peers]:
            del self._early_replies[node_id]
        self.receiver.forget_others(peers)

    def _close(self, link: Link) -> None:
        link.closed = True
        link.cancel_scope.cancel()
        link.room.set()
        del self._links[link.node_id]
        self._fail_pending(link.node_id)

    def link_broken(self, link: Link) -> None:
        # Requests in flight on a broken connection may never be answered: fail them now
        # so callers retry (by the then-current view) instead of hanging.
        self._fail_pending(link.node_id)

    def _fail_pending(self, node_id: str) -> None:
        for req, pending in list(self._pending.items()):
            if pending.node == node_id:
                del self._pending[req]
                pending.result = PeerUnavailable(node_id)
                pending.done.set()

    def clear(self) -> int:
        """Drop everything queued to every peer, and reconnect; the number dropped.

        For a node that learns it was declared down: what it queued while cut off belongs
        to a life the cluster has ended, and receivers would refuse it anyway.  Requests
        waiting for answers fail at once (their callers decide again by the new view).
        """
        dropped = 0
        for link in self._links.values():
            dropped += link.queued + len(link.window)
            link.queue.clear()
            link.queued = 0
            link.generation += 1
            link.room.set()
            link.room = trio.Event()
            # The frames in flight belong to the ended life too; the next connection opens
            # a new session, which receivers that refused the old one accept.
            link.window = OutboundWindow(self.max_unacked_bytes)
            link.window_room.set()
            if link.connection_scope is not None:
                # The connection may be stuck behind a partition with frames of the ended
                # life in its buffers: start a fresh one rather than wait out TCP's backoff.
                link.connection_scope.cancel()
        self._fail_all_pending()
        return dropped

    def _fail_all_pending(self) -> None:
        for node in {pending.node for pending in self._pending.values()}:
            self._fail_pending(node)

    def stats(self) -> dict[str, dict[str, int]]:
        return {
            node: {"queued": link.queued, "sent": link.sent_messages,
                   "frames": link.sent_frames, "bytes": link.sent_bytes,
                   "dropped": link.dropped,
                   "connected": int(link.connected),
                   "unacked": len(link.window), "replaced": link.replaced,
                   "replayed": link.replayed,
                   "protocol_errors": self.protocol_errors.get(node, 0)}
            for node, link in self._links.items()
        }

    # -- sending --------------------------------------------------------------------------

    def send(self, node_id: str, message: LinkMessage) -> bool:
        """Queue a message that may be dropped under back-pressure; False if it was."""
        link = self._links.get(node_id)
        return link.push(message) if link is not None else False

    def send_frames(self, node_id: str, section: int, topic: str, frames: bytes | memoryview,
                    count: int = 1) -> bool:
        """Queue encoded QoS 0 PUBLISHes in a packed batch (may be dropped like ``send``)."""
        link = self._links.get(node_id)
        return link.push_frames(section, topic, frames, count) if link is not None else False

    def send_control(self, node_id: str, message: LinkMessage) -> bool:
        """Queue a control message past the back-pressure bound (they are few and small,
        and dropping one, a route set say, would cost more than the room it takes)."""
        link = self._links.get(node_id)
        if link is None:
            return False
        link.append(message)
        return True

    async def send_wait(self, node_id: str, message: LinkMessage) -> None:
        link = self._links.get(node_id)
        if link is None:
            raise PeerUnavailable(node_id)
        await link.push_wait(message)

    @overload
    async def request(self, node_id: str, message: Request, timeout: float = ...,
                      *, expect: None = None) -> None: ...

    @overload
    async def request(self, node_id: str, message: Request, timeout: float = ...,
                      *, expect: type[R]) -> R: ...

    async def request(self, node_id: str, message: Request, timeout: float = 10.0,
                      *, expect: type[R] | None = None) -> R | None:
        """Send ``message`` with a fresh request id and wait for the peer's answer.

        ``expect`` is the type of answer the caller needs; an acceptance with another body
        (a peer's bug) is a ``RemoteError`` like a refusal, so the caller retries or gives up
        the way it does for any refusal instead of tripping over the wrong type.
        """
        req, pending = self._expect_answer(node_id)
        try:
            await self.send_wait(node_id, msgspec.structs.replace(message, req=req))
        except BaseException:
            self._pending.pop(req, None)
            raise
        return await self._answer(node_id, message, req, pending, timeout, expect)

    def request_now(self, node_id: str, message: Request, timeout: float = 10.0
                    ) -> Coroutine[Any, Any, None]:
        """``request``, with ``message`` queued before this returns (past the back-pressure
        bound, as ``send_control``); the answer is awaited through what it returns.

        For messages whose order against what other tasks send next matters: a route
        registration queued in the SUBSCRIBE's own turn reaches the owner before a publish
        that another client sent right after that SUBSCRIBE (one link is one FIFO), as one
        broker would order them.  Raises ``PeerUnavailable`` at once, like ``request``."""
        req, pending = self._expect_answer(node_id)
        self._links[node_id].append(msgspec.structs.replace(message, req=req))
        return self._answer(node_id, message, req, pending, timeout, None)

    def _expect_answer(self, node_id: str) -> tuple[int, _Pending]:
        link = self._links.get(node_id)
        if link is None or link.down:
            raise PeerUnavailable(f"{node_id}: no working link")
        req = next(self._ids)
        pending = self._pending[req] = _Pending(node_id)
        return req, pending

    async def _answer(self, node_id: str, message: Request, req: int, pending: _Pending,
                      timeout: float, expect: type[R] | None) -> R | None:
        try:
            with trio.move_on_after(timeout):
                await pending.done.wait()
        finally:
            self._pending.pop(req, None)
        if not pending.done.is_set():
            raise PeerUnavailable(f"{node_id}: no answer within {timeout}s")
        if isinstance(pending.result, Exception):
            raise pending.result
        if not pending.ok:
            raise RemoteError(str(pending.result))
        if expect is None:
            return None
        if not isinstance(pending.result, expect):
            raise RemoteError(f"{node_id} answered {type(message).__name__} with "
                              f"{type(pending.result).__name__}, not {expect.__name__}")
        return pending.result

    def reply(self, node_id: str, req: int, ok: bool, body: Reply | str | None = None) -> None:
        if req:
            answer = Ack(req, ok, body)
            link = self._links.get(node_id)
            if link is not None:
                link.append(answer)  # never dropped: a requester waits for it
            elif len(self._early_replies) < MAX_EARLY_REPLIES:
                # A peer that just joined asks before our view (and so our link to it)
                # exists: keep the answer for the link ``update_peers`` is about to open.
                self._early_replies.setdefault(node_id, []).append(answer)

    # -- what the receiving end hands back ---------------------------------------------

    def _protocol_error(self, node: str, exc: PeerProtocolError) -> PeerProtocolError:
        """Count and log ``exc`` from ``node``; the caller raises it to close the link."""
        self.protocol_errors[node] = self.protocol_errors.get(node, 0) + 1
        log.warning("closing the link from %s: %s", node, exc)
        return exc

    def _on_ack(self, message: Ack) -> None:
        pending = self._pending.pop(message.req, None)
        if pending is not None:
            pending.ok = message.ok
            pending.result = message.body
            pending.done.set()


__all__ = ["STREAM_KIND", "Links", "PeerProtocolError", "PeerUnavailable", "RemoteError"]
