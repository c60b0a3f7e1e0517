"""Persistent, authenticated, batched links between nodes, with request/response on top.

Theory of operation
-------------------
Every node keeps one *outbound* link to every other live member.  A link is a connection to
the peer's cluster port (the RPC server of ``mqttring.rpc``: HMAC challenge both ways,
so a peer without the cluster secret is refused and logged there) switched into the
``data.link`` stream kind.  Messages travel one way on it: A's messages to B go on A's link
to B, B's replies on B's link to A.  That keeps each link a plain FIFO with one writer task.
The sending end of one link is ``cluster/outbound.py`` (``Link``), the receiving end of all
of them ``cluster/inbound.py``; this module owns both and the requests on top.

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
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar, overload

import msgspec
import trio

from mqttring.cluster.errors import PeerProtocolError, PeerUnavailable, RemoteError
from mqttring.cluster.inbound import ACK_INTERVAL, Admit, LinkReceiver, MessageHandler
from mqttring.cluster.messages import Ack, LinkMessage, Reply, Request
from mqttring.cluster.outbound import STREAM_KIND, Link
from mqttring.rpc import MAX_FRAME, FramedStream, Peer

log = logging.getLogger("mqttring.cluster.links")

MAX_QUEUED = 50_000
#: Answers kept for peers we have no link to yet (a joining node asks before we know it).
MAX_EARLY_REPLIES = 10_000
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
                                     on_protocol_error=self.protocol_error)
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
        dropped = sum(link.discard() for link in self._links.values())
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

    def protocol_error(self, node: str, exc: PeerProtocolError) -> PeerProtocolError:
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
