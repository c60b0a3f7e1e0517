"""The QoS 2 handshakes of a ``Session``: the steps QoS 2 adds, both ways.

Apart from ``session.py`` because only QoS 2 traffic reaches them, never the path every
message takes (``deliver``, ``_pump``, ``on_puback``), and each direction carries its own
crash story:

* Outbound: PUBREC answered by PUBREL, PUBCOMP ending the delivery.  A persistent session
  holds the PUBREL back until the PUBREC's state is stored durably (``held_releases``,
  documented where ``Session`` declares it).
* Inbound QoS 2 (method B of figure 4.3): a packet id stays in ``inbound_qos2`` from PUBLISH
  until PUBREL, so a redelivered PUBLISH with the same id is acknowledged but not routed again.
  The id comes with the message's identity (``Message.mid``), stored durably *before* the
  message is routed, until its PUBREC leaves: a node that dies in between (or whose routing
  failed) leaves the id unacknowledged, and the client's resend, at whichever node holds the
  session next, is routed again with the same identity, which every session that got the
  first copy takes for the same message.  Stored after routing, as before 2026-11-28, a
  home killed in between lost the id and the resend became a second message at QoS 2.

A completed outbound QoS 2 message of a persistent session leaves a marker in the store in
place of its row (``Completed``: its identity and when), for as long as a retry of it can
come, so that a session loaded on another node does not take that retry's copy for a new
message; ``completed`` lists the markers so that they are deleted after that time.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from mqttring.protocol.codec import encode as encode_packet
from mqttring.protocol.message import new_mid
from mqttring.protocol.outbound import Completed, Outbound, OutState
from mqttring.protocol.packets import PubRel

if TYPE_CHECKING:
    from mqttring.protocol.session import SessionLimits


class QoS2Handshakes:
    """The QoS 2 rules of ``Session``, which inherits them and holds their state (its
    fields, documented there)."""

    __slots__ = ()

    inflight: dict[int, Outbound]
    inbound_qos2: dict[int, int]
    output: bytearray | None
    _dirty: dict[int, Outbound | Completed | None]
    _dirty_qos2: dict[int, int | None]
    durable_due: bool
    held_releases: list[int] | None
    completed: deque[tuple[int, float]] | None
    limits: SessionLimits

    if TYPE_CHECKING:
        @property
        def persistent(self) -> bool: ...

        def _forget(self, entry: Outbound) -> None: ...

        def _pump(self, out: bytearray) -> None: ...

    # -- outbound QoS 2 ---------------------------------------------------------------------

    def on_pubrec(self, packet_id: int) -> bool:
        """The client has the QoS 2 message: answer PUBREL.  A persistent session holds
        the PUBREL back until the new state is stored durably (``held_releases``); a PUBREC
        repeated for a message whose state is stored already is answered at once."""
        entry = self.inflight.get(packet_id)
        if entry is None or entry.state not in (OutState.AWAIT_PUBREC, OutState.AWAIT_PUBCOMP):
            return False
        held = self.held_releases
        if self.persistent and (entry.state == OutState.AWAIT_PUBREC
                                or (held is not None and packet_id in held)):
            entry.state = OutState.AWAIT_PUBCOMP
            self._dirty[entry.seq] = entry
            if held is None:
                self.held_releases = [packet_id]
            elif packet_id not in held:
                held.append(packet_id)
            return True
        entry.state = OutState.AWAIT_PUBCOMP
        if self.output is not None:
            self.output += encode_packet(PubRel(packet_id))
        return True

    def take_held_releases(self) -> int:
        """Mark the records of the held PUBRELs to be written again, durably, and say how
        many there are: once a durable write of this session's changes taken after this
        call returns, ``release`` (with this count) may send them.  They stay held until
        then, so a failed write leaves them unsent and ``attach`` never sends one early."""
        held = self.held_releases
        if not held:
            return 0
        inflight = self.inflight
        for pid in held:
            entry = inflight.get(pid)
            if entry is not None and entry.state == OutState.AWAIT_PUBCOMP:
                self._dirty[entry.seq] = entry
        self.durable_due = True
        return len(held)

    def release(self, count: int) -> bool:
        """Send the first ``count`` held PUBRELs, now stored durably, in PUBREC order
        [MQTT-4.6.0-3]; one completed or dropped meanwhile is skipped.  While no connection
        is attached nothing is written: ``attach`` sends a PUBREL for every released message
        still awaiting its PUBCOMP.  True if anything was written."""
        held = self.held_releases
        if not held or count <= 0:
            return False
        taken = held[:count]
        del held[:count]
        if not held:
            self.held_releases = None
        out = self.output
        if out is None:
            return False
        inflight = self.inflight
        sent = False
        for pid in taken:
            entry = inflight.get(pid)
            if entry is not None and entry.state == OutState.AWAIT_PUBCOMP:
                out += encode_packet(PubRel(pid))  # type: ignore[arg-type]
                sent = True
        return sent

    def on_pubrec_failed(self, packet_id: int, now: float | None = None) -> bool:
        """MQTT 5: a PUBREC with a failure reason code (>= 0x80) ends the QoS 2 delivery:
        no PUBREL follows, the packet id is free and the message is done (section 4.3.3).
        True if it freed a window slot (the caller pumps, as for ``on_puback``)."""
        entry = self.inflight.get(packet_id)
        if entry is None or entry.state != OutState.AWAIT_PUBREC:
            return False
        del self.inflight[packet_id]
        self._complete(entry, now)
        return True

    def on_pubcomp(self, packet_id: int, pump: bool = True, now: float | None = None
                   ) -> bool:
        """The QoS 2 delivery is complete.  ``now``: wall-clock UNIX seconds, for the
        ``Completed`` marker (the current time when not given)."""
        entry = self.inflight.get(packet_id)
        if entry is None or entry.state != OutState.AWAIT_PUBCOMP:
            return False
        del self.inflight[packet_id]
        self._complete(entry, now)
        if pump and self.output is not None:
            self._pump(self.output)
        return True

    def _complete(self, entry: Outbound, now: float | None) -> None:
        """The client is done with ``entry``: a persistent session's record of a message
        with an identity becomes its ``Completed`` marker (stored lazily, as the row's
        deletion was: lost in a crash, the row it replaces names the identity as well)."""
        mid = entry.message.mid
        if not (mid and self.persistent and self.limits.qos2_dedup_window > 0):
            self._forget(entry)
            return
        if now is None:
            now = time.time()
        self._dirty[entry.seq] = Completed(mid, now)
        self.note_completed(entry.seq, now, now)

    def note_completed(self, seq: int, at: float, now: float) -> None:
        """List the marker stored under ``seq`` (completed ``at``); delete the markers
        past ``qos2_dedup_seconds`` at ``now`` or beyond ``qos2_dedup_window`` of them:
        a retry of theirs can no longer come, and a session's record stays bounded."""
        markers = self.completed
        if markers is None:
            markers = self.completed = deque()
        markers.append((seq, at))
        limits = self.limits
        oldest = now - limits.qos2_dedup_seconds
        dirty = self._dirty
        while markers and (len(markers) > limits.qos2_dedup_window or markers[0][1] < oldest):
            dirty[markers.popleft()[0]] = None
        if not markers:
            self.completed = None

    # -- inbound QoS 2 ----------------------------------------------------------------------

    def begin_inbound_qos2(self, packet_id: int) -> int:
        """A QoS 2 PUBLISH came with ``packet_id``: the identity to route it with (its
        first one if this is a resend of a message not acknowledged yet), or 0 if its
        PUBREC was sent already (answer it again, route nothing)."""
        mid = self.inbound_qos2.get(packet_id)
        if mid is None:
            mid = self.inbound_qos2[packet_id] = new_mid()
            if self.persistent:
                self._dirty_qos2[packet_id] = mid
                self.durable_due = True  # before it is routed: see the module docstring
        return mid

    def inbound_qos2_acknowledged(self, packet_id: int) -> None:
        """Its PUBREC is being sent: a resend from now on is not routed again.  Stored
        lazily: lost in a crash, the resend is routed with the same identity."""
        if self.inbound_qos2.get(packet_id):
            self.inbound_qos2[packet_id] = 0
            if self.persistent:
                self._dirty_qos2[packet_id] = 0

    def record_inbound_qos2(self, packet_id: int, mid: int) -> None:
        """The home of a session whose client is on another node: what its edge decided
        (``begin_inbound_qos2``: ``mid``; ``inbound_qos2_acknowledged``: 0)."""
        if self.inbound_qos2.get(packet_id) != mid:
            self.inbound_qos2[packet_id] = mid
            if self.persistent:
                self._dirty_qos2[packet_id] = mid
                if mid:
                    self.durable_due = True

    def release_inbound_qos2(self, packet_id: int) -> None:
        if packet_id in self.inbound_qos2:
            del self.inbound_qos2[packet_id]
            if self.persistent:
                self._dirty_qos2[packet_id] = None
