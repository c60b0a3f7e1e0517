"""The receiving end of the links: every peer's frames applied once, in order, fenced, and
acknowledged.  ``links.py`` is the sending end and owns one of these.

A peer's link to this node is a connection it opened to our cluster port (``data.link``
stream kind of ``mqttring.rpc``).  For each peer this end keeps what of the peer's current
link session it applied (``InboundSession``, ``cluster/replay.py``) and the one connection
it serves: a newer connection from the same peer replaces the one being served, since the
peer gave it up and replays on the new one whatever we did not acknowledge.

Fencing: the receiver asks ``admit(node, incarnation, epoch)`` of every frame before it
applies anything.  A frame it refuses is counted (``refused_frames``), never applied, and
acknowledged like any other, so that replay does not send it again and the link goes on
with the next frame (a sender in its next life stamps anew).  Refusing the whole session
instead broke a restarted node's catch-up: it links before it is admitted.

Protocol errors (a frame that is not a ``Frame`` of this version, a gap in a session's
numbering, a message whose content fails its checks) go to ``on_protocol_error``, which
counts them, and close the connection; the peer reconnects and the node keeps running.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from mqttring.cluster.errors import PeerProtocolError
from mqttring.cluster.messages import Ack, Batch, LinkMessage, decode_frame
from mqttring.cluster.replay import ACK, InboundSession, Verdict
from mqttring.rpc import FramedStream, Peer

log = logging.getLogger("mqttring.cluster.links")

#: Default ``link_ack_interval``: the receiver acknowledges at most this often per connection.
ACK_INTERVAL = 0.01

#: Called for every inbound message but ``Ack``, in order; it must not block: anything that waits
#: (a store write, an answer from a third node) runs in a task it starts, or the link's
#: reader would stall and two nodes waiting on each other's links would deadlock.
MessageHandler = Callable[[str, LinkMessage], None]
#: May frames from ``node`` in ``incarnation`` be applied here?
Admit = Callable[[str, int, int], bool]


class Acknowledger:
    """Writes the receiver's acknowledgements on one served connection: the number of the
    last frame applied, at most once per ``interval`` (acknowledging every burst of frames
    cost the pair benchmark 7% of its QoS 1 rate; the sender needs acknowledgements only to
    free its window and to tell a stall, both on a scale of seconds).  The only writer on
    that connection."""

    def __init__(self, stream: FramedStream, inbound: InboundSession,
                 interval: float = ACK_INTERVAL) -> None:
        self._stream = stream
        self._interval = interval
        self._inbound = inbound
        self._event = trio.Event()
        self._sent = 0

    def due(self) -> None:
        self._event.set()

    async def run(self) -> None:
        while True:
            await self._event.wait()
            await trio.sleep(self._interval)
            self._event = trio.Event()
            last = self._inbound.last
            if last is not None and last != self._sent:
                self._sent = last
                await self._stream.stream.send_all(ACK.pack(last))


#: What a connection that ended raises, in whichever task noticed it first.
CONNECTION_ENDED = (EOFError, trio.BrokenResourceError, trio.ClosedResourceError)


def unwrapped(group: BaseExceptionGroup) -> BaseException:
    """What a served connection's nursery raised, bare, as the RPC server expects it.

    The frame loop and the acknowledger can both see a connection end (a peer reset: EOF
    in one, a broken write in the other): that is one ordinary end, not an error with a
    traceback.  A protocol error among them is what ended it.  Anything else (a bug)
    stays a group.
    """
    ended, rest = group.split(CONNECTION_ENDED)
    if rest is None:
        assert ended is not None
        return ended.exceptions[0]
    if len(rest.exceptions) == 1 and not isinstance(rest.exceptions[0], BaseExceptionGroup):
        return rest.exceptions[0]
    return group


class LinkReceiver:
    """Serves every peer's link to this node (``serve_stream`` is the RPC stream handler).

    ``on_answer`` takes the peer's answers to our requests; ``on_lost(node)`` is called
    when a served connection ends other than by its replacement (the answers in flight on
    it are lost with it); ``on_protocol_error`` counts and logs an error and gives it back
    to be raised.
    """

    def __init__(self, handler: MessageHandler, admit: Admit, *,
                 max_frame: int,
                 ack_interval: float = ACK_INTERVAL,
                 on_answer: Callable[[Ack], None],
                 on_lost: Callable[[str], None],
                 on_protocol_error: Callable[[str, PeerProtocolError], PeerProtocolError],
                 ) -> None:
        self.max_frame = max_frame
        self.ack_interval = ack_interval
        self._handler = handler
        self._admit = admit
        self._on_answer = on_answer
        self._on_lost = on_lost
        self._on_protocol_error = on_protocol_error
        #: Frames refused (never applied) because their sender was fenced off (stale or
        #: down incarnation), or they were meant for an earlier life of this node.
        self.refused_frames = 0
        self.received_messages = 0
        #: Per sending peer: what of its current link session this node applied.
        self._inbound: dict[str, InboundSession] = {}
        #: Per sending peer: the connection being served (a newer one replaces it).
        self._serving: dict[str, trio.CancelScope] = {}

    def forget_others(self, peers: dict[str, str]) -> None:
        """Drop what was applied from peers no longer in ``peers``: a peer that comes back
        links in a new session anyway."""
        for node_id in [n for n in self._inbound if n not in peers]:
            del self._inbound[node_id]

    async def serve_stream(self, stream: FramedStream, peer: Peer, body: dict[str, Any]) -> None:
        """RPC stream handler for ``data.link``: dispatch every message of every frame."""
        node = peer.node_id
        # The RPC dispatch hands only a map here; a direct caller (a test, a future
        # transport) may not, and a list once surfaced as an AttributeError traceback.
        session = body.get("session") if isinstance(body, dict) else None
        if type(session) is not int or session < 1:
            raise self._on_protocol_error(node, PeerProtocolError(
                f"data link without a session number: {session!r}"))
        inbound = self._inbound.get(node)
        if inbound is None or inbound.session != session:
            inbound = self._inbound[node] = InboundSession(session)
        previous = self._serving.pop(node, None)
        if previous is not None:
            previous.cancel()  # the peer replaced that connection: this one replays it
        scope = self._serving[node] = trio.CancelScope()
        try:
            with scope:
                async with trio.open_nursery() as nursery:
                    acks = Acknowledger(stream, inbound, self.ack_interval)
                    nursery.start_soon(acks.run)
                    await self._serve_frames(stream, node, inbound, acks)
        except BaseExceptionGroup as group:
            raise unwrapped(group) from None
        finally:
            if self._serving.get(node) is scope:
                del self._serving[node]
            if not scope.cancelled_caught:
                # The peer's answers to our requests travel on this connection: those in
                # flight on it are lost with it, unless a newer connection replays them.
                # Fail the requests now so that their callers retry (on the connection the
                # peer opens next) instead of waiting out their timeouts.
                self._on_lost(node)

    async def _serve_frames(self, stream: FramedStream, node: str,
                            inbound: InboundSession, acks: Acknowledger) -> None:
        handler = self._handler
        stream.max_frame = self.max_frame
        refused_here = 0
        while True:
            try:
                frame = decode_frame(await stream.receive_bytes())
                verdict = inbound.verdict(frame.seq)
            except PeerProtocolError as exc:
                raise self._on_protocol_error(node, exc) from None
            if verdict is Verdict.DUPLICATE:
                acks.due()
                continue
            incarnation = frame.incarnation
            if not self._admit(node, incarnation, frame.epoch):
                # Fenced off: never applied, and acknowledged so that it is not replayed.
                self.refused_frames += 1
                if not refused_here:
                    log.warning("refused a frame from %s (incarnation %d, epoch %d): "
                                "fenced off (later ones on this connection are counted)",
                                node, incarnation, frame.epoch)
                refused_here += 1
                inbound.applied(frame.seq)
                acks.due()
                continue
            for message in frame.messages:
                try:
                    if type(message) is Ack:
                        self._on_answer(message)
                    else:
                        handler(node, message)
                except (ValueError, TypeError, KeyError, IndexError) as exc:
                    # Well-typed, yet its content fails a check (a batch index that does not
                    # cover its blob, a database we do not replicate): a version skew or a
                    # bug of an authenticated peer.  Close its link, keep the node running.
                    raise self._on_protocol_error(node, PeerProtocolError(
                        f"bad {type(message).__name__} message: {exc}")) from None
                self.received_messages += message.count if type(message) is Batch else 1
            inbound.applied(frame.seq)
            acks.due()


__all__ = ["ACK_INTERVAL", "Acknowledger", "Admit", "LinkReceiver", "MessageHandler"]
