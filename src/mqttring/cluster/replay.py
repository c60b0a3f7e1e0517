"""Link frames numbered, acknowledged and replayed, so that a stalled connection can be
replaced without losing what was on it.  Decided without I/O; ``links.py`` runs it.

Why
---
A link carries much that is sent once and never acknowledged by the layer above (relayed
session bytes, a remote client's PUBACKs, will registrations, QoS 0 batches).  As long as
a frame handed to TCP could be lost with its connection, a link could never give up on a
live connection: one stuck in TCP's retransmission backoff was waited out.  Measured with
the fault suite's ``sick`` scenario (40% of one node's packets lost both ways), that wait
was the stall: retransmission timeouts inflated to 14 s and more, and one 5-node run's
links to the sick node were still backing off 30 s after the loss had ended, so routes
never converged.  TCP's own timeouts cannot be capped safely (Linux ends a connection
after 15 timeouts at the cap, and what was on it with it).

How
---
Each link has a *session* (a random id, new for each life of the link: a new ``Link``, or
the sender's queue discarded by ``Links.clear``).  Every frame carries the next number of
its session.  The receiver applies frames in order, at most once per session, and writes
back the number of the last one it applied (8 bytes, big-endian; cumulative, so one
acknowledgement covers every frame before it: ``links.py`` writes at most one per 10 ms).
The sender keeps every frame until it is acknowledged (``OutboundWindow``), sends them all
again, in order, on its next connection, and the receiver skips those it already applied
(``InboundSession``).  So a connection may now be replaced at any moment:
the sender replaces one whose oldest unacknowledged frame has seen no progress for the
stall timeout while TCP retransmits, or for twice that with every byte delivered and no
acknowledgement back (``StallJudge``), and starts again with a fresh connection (and a
fresh retransmission timer).

A frame the receiver refuses (fencing: the sender's life has ended, or the frame was
meant for an earlier life of the receiver) is never applied, and it is acknowledged like
any other, so that replay does not send it again.
"""

from __future__ import annotations

import secrets
import struct
from collections import deque
from enum import Enum

from mqttring.cluster.errors import PeerProtocolError
from mqttring.tcp_options import SendState

#: An acknowledgement on the wire: the number of the last frame applied.
ACK = struct.Struct(">Q")


def new_session() -> int:
    """A session id: random, so that a restarted sender never resumes an old numbering."""
    return secrets.randbits(62) + 1


class OutboundWindow:
    """The sender's frames in flight on one link session: numbered, kept until
    acknowledged, replayed on each new connection."""

    def __init__(self, max_bytes: int) -> None:
        self.session = new_session()
        self.max_bytes = max_bytes
        self._next = 1
        self._frames: deque[tuple[int, bytes]] = deque()
        self.bytes = 0
        self.acked = 0
        #: When the oldest unacknowledged frame last saw progress (sent into an empty
        #: window, an acknowledgement, a new connection); None with nothing in flight.
        self.progress_at: float | None = None

    def __len__(self) -> int:
        return len(self._frames)

    def full(self) -> bool:
        """No room for another frame until acknowledgements arrive (never with nothing in
        flight: a frame larger than the window still goes, alone)."""
        return self.bytes >= self.max_bytes

    def next_seq(self) -> int:
        return self._next

    def sent(self, seq: int, payload: bytes, now: float) -> None:
        """The frame numbered ``seq`` (``next_seq()``) is being sent."""
        assert seq == self._next
        self._next += 1
        if not self._frames:
            self.progress_at = now
        self._frames.append((seq, payload))
        self.bytes += len(payload)

    def on_ack(self, seq: int, now: float) -> None:
        """The receiver applied every frame up to ``seq``."""
        if seq >= self._next:
            raise PeerProtocolError(f"acknowledgement of frame {seq}, never sent "
                                    f"(last sent {self._next - 1})")
        if seq <= self.acked:
            return
        frames = self._frames
        while frames and frames[0][0] <= seq:
            self.bytes -= len(frames.popleft()[1])
        self.acked = seq
        self.progress_at = now if frames else None

    def reconnected(self, now: float) -> list[bytes]:
        """A new connection: the frames to send again first, in order; it gets a whole
        stall timeout before it counts as stalled."""
        if self._frames:
            self.progress_at = now
        return [payload for _, payload in self._frames]

    def stalled_for(self, now: float) -> float:
        """Seconds the oldest frame in flight has seen no progress (0 with none)."""
        return 0.0 if self.progress_at is None else now - self.progress_at


class StallJudge:
    """Decides when a link connection with frames in flight is replaced.  ``links.py`` asks
    every quarter of the stall timeout, with what the window and the kernel say.

    A connection is stalled after ``timeout`` without progress while TCP retransmits.  It
    is stalled after twice that whatever TCP does, once the kernel holds nothing of ours
    unacknowledged: every byte reached the peer's TCP, so what is missing is the peer's
    acknowledgement, lost on the way back and retransmitted by the *peer's* kernel, which
    no counter on this end shows (a sick node's link waited 8 s for a sample to catch TCP
    retransmitting).  A peer merely slow to apply is given the timeout; a large frame still
    on its way (bytes queued, nothing retransmitting) is never cut short.  Without the
    kernel's word (``tcp`` None) the stall alone decides.

    Counting retransmissions *between* samples as well (``tcpi_total_retrans`` since the
    last progress) was tried and dropped: it replaced 3-6 connections per 5-node ``sick``
    run instead of one, and the longest publish gaps grew from 2.7-3.7 s to 2.5-12.7 s
    (docs/faults.md): each replacement is a new handshake through the same lossy path.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    def why_stalled(self, stalled_for: float, tcp: SendState | None) -> str | None:
        """Why the connection counts as stalled (for the log), or None if it does not."""
        if stalled_for <= self.timeout:
            return None
        if tcp is None:
            return "TCP state unknown"
        if tcp.retransmitting:
            return "TCP retransmits"
        if stalled_for > 2 * self.timeout and tcp.queued == 0:
            return "every byte delivered, no acknowledgement back"
        return None


class Verdict(Enum):
    APPLY = "apply"
    DUPLICATE = "duplicate"


class InboundSession:
    """What the receiver applied of one sender's session."""

    def __init__(self, session: int) -> None:
        self.session = session
        #: The last frame applied; None until this node sees the session's first frame
        #: (a restarted receiver meets a session mid-way: what came before was applied by
        #: its previous life, which acknowledged it).
        self.last: int | None = None

    def verdict(self, seq: int) -> Verdict:
        last = self.last
        if seq < 1:
            raise PeerProtocolError(f"frame number {seq} in session {self.session}")
        if last is None or seq == last + 1:
            return Verdict.APPLY
        if seq <= last:
            return Verdict.DUPLICATE
        raise PeerProtocolError(f"frame {seq} after {last}: frames {last + 1}..{seq - 1} of "
                                f"session {self.session} never arrived")

    def applied(self, seq: int) -> None:
        self.last = seq


__all__ = ["ACK", "InboundSession", "OutboundWindow", "Verdict", "new_session"]
