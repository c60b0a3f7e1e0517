"""The sending end of one link: a queue of messages for one peer and the task that writes it.

``links.py`` owns one ``Link`` per live peer (and the request/response on top of them);
``inbound.py`` is the receiving end.  A link is a connection to the peer's cluster port
(``data.link`` stream kind of ``mqttring.rpc``).  Its writer drains the queue into frames,
numbered and kept until the peer acknowledges them (``OutboundWindow``), reconnects with
backoff for as long as the peer is in the view, replays what is unacknowledged first, and
replaces a connection ``StallJudge`` finds stalled.  Plain QoS 0 publishes are appended to
the packed batch at the queue's tail (``push_frames``, ``cluster/wire.py``).  What it needs
of its owner is ``LinkOwner``: the settings and the callbacks on connection and breakage.
"""

from __future__ import annotations

import logging
import ssl
from collections import deque
from typing import Protocol

import trio

from mqttring.cluster import wire
from mqttring.cluster.errors import PeerProtocolError, PeerUnavailable
from mqttring.cluster.messages import Batch, LinkMessage, encode_frame
from mqttring.cluster.replay import ACK, OutboundWindow, StallJudge
from mqttring.cluster.wire import MAX_BATCH_BYTES
from mqttring.rpc import FramedStream, RpcClient
from mqttring.tcp_options import discard_unsent, send_state

log = logging.getLogger("mqttring.cluster.links")

STREAM_KIND = "data.link"
#: Messages one frame carries at most.
MAX_BATCH = 2_000
RECONNECT_MIN = 0.05
RECONNECT_MAX = 2.0


class LinkOwner(Protocol):
    """What a ``Link`` reads of the ``Links`` that owns it."""

    node_id: str
    key: bytes
    tls: ssl.SSLContext | None
    max_queued: int
    max_frame: int
    max_unacked_bytes: int
    stall_timeout: float

    def stamp(self) -> tuple[int, int]: ...
    def on_connected(self, node_id: str) -> None: ...
    def link_broken(self, link: Link) -> None: ...
    def protocol_error(self, node: str, exc: PeerProtocolError) -> PeerProtocolError: ...


class Link:
    """The outbound half towards one peer: a queue and the task that drains it."""

    def __init__(self, owner: LinkOwner, node_id: str, address: str) -> None:
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

    def discard(self) -> int:
        """Drop everything queued and in flight, and reconnect; the number dropped
        (``Links.clear``: it all belongs to a life the cluster has ended)."""
        dropped = self.queued + len(self.window)
        self.queue.clear()
        self.queued = 0
        self.generation += 1
        self.room.set()
        self.room = trio.Event()
        # The frames in flight belong to the ended life too; the next connection opens a
        # new session, which receivers that refused the old one accept.
        self.window = OutboundWindow(self.owner.max_unacked_bytes)
        self.window_room.set()
        if self.connection_scope is not None:
            # The connection may be stuck behind a partition with frames of the ended life
            # in its buffers: start a fresh one rather than wait out TCP's backoff.
            self.connection_scope.cancel()
        return dropped

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
            self.owner.protocol_error(self.node_id, exc)
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


__all__ = ["STREAM_KIND", "Link", "LinkOwner"]
