"""What the broker answers a client through its ``ServerConnection``, in order.

PUBACK/PUBREC once the core accepted a publish, SUBACK, UNSUBACK and PINGRESP, each in
the order a broker that handles one packet at a time would send them: the core answers
runs of packets in the order they came, and the QoS 2 answers the protocol machine gives
by itself (PUBCOMP to a PUBREL, PUBREC to a resent PUBLISH) wait behind the PUBRECs of the
QoS 2 PUBLISHes read before them (``hold``) [MQTT-4.6.0-3].  Apart from the machine that
reads packets (``connection``) because it is the other half: what goes out, not what comes
in; ``ServerConnection`` inherits it and holds the state both use.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from mqttring.protocol.codec import encode as encode_packet
from mqttring.protocol.events import ConnState, PingRequested, PublishReceived
from mqttring.protocol.packets import SUBACK_FAILURE, PingResp, SubAck, UnsubAck
from mqttring.protocol.packets5 import PubAck5, PubRec5, SubAck5, UnsubAck5
from mqttring.protocol.reasons5 import encode_with_reason

if TYPE_CHECKING:
    from mqttring.protocol.connection5 import V5Link
    from mqttring.protocol.session import Session


class Answers:
    """The answering half of ``ServerConnection`` (its attributes, declared here)."""

    __slots__ = ()

    state: ConnState
    session: Session | None
    _answering: bool
    _out: bytearray
    _qos2_unanswered: dict[int, list[tuple[int, bool]] | None] | None
    _v5: V5Link | None

    def qos2_read(self, packet_id: int) -> None:
        """A QoS 2 PUBLISH goes to the core, which answers it (``ack_publish``) once it is
        accepted: until then, answers that must follow its PUBREC wait (``hold``)."""
        if self._qos2_unanswered is None:
            self._qos2_unanswered = {}
        self._qos2_unanswered[packet_id] = None

    def hold(self, packet_id: int, release: bool) -> bool:
        """Hold back the PUBCOMP of a PUBREL (``release``) whose PUBLISH the core is still
        accepting, or the PUBREC of a resent QoS 2 PUBLISH while earlier ones wait for
        theirs, until the PUBRECs of the QoS 2 PUBLISHes read before it are out: the order
        of a broker that handles one packet at a time.  Without it a client that sent
        PUBLISH and PUBREL at once got PUBCOMP before PUBREC, and PUBRECs could leave out
        of their PUBLISHes' order [MQTT-4.6.0-3].  False: nothing to wait for, answer now."""
        pending = self._qos2_unanswered
        if not pending or (release and packet_id not in pending):
            return False
        last = next(reversed(pending))
        held = pending[last]
        if held is None:
            held = pending[last] = []
        held.append((packet_id, release))
        return True

    def _answer_held(self, held: list[tuple[int, bool]]) -> None:
        """The answers ``hold`` kept behind a PUBREC that just went out, in order."""
        session = self.session
        assert session is not None
        for packet_id, release in held:
            if release:
                if packet_id in session.inbound_qos2:
                    if self._v5 is not None:
                        self._v5.inbound = max(0, self._v5.inbound - 1)
                    session.release_inbound_qos2(packet_id)
                self._out += bytes((0x70, 2, packet_id >> 8, packet_id & 0xFF))  # PUBCOMP
            else:
                self._out += bytes((0x50, 2, packet_id >> 8, packet_id & 0xFF))  # PUBREC

    def ack_publish(self, packet_id: int | None, qos: int, reason_code: int = 0) -> None:
        """Acknowledge a routed PUBLISH: PUBACK for QoS 1, PUBREC for QoS 2.

        ``reason_code`` (MQTT 5 only; a 3.1.1 client is always told success): a failure
        code such as 0x87, with a reason string if the client wants one.  A PUBREC with a
        failure code ends the QoS 2 exchange, so its packet id is released at once."""
        if (self.state is ConnState.CLOSED and not self._answering) or packet_id is None or not qos:
            return
        if qos == 2 and self._qos2_unanswered:
            held = self._qos2_unanswered.pop(packet_id, None)
            self._ack_publish(packet_id, qos, reason_code)
            if held:
                self._answer_held(held)
            return
        self._ack_publish(packet_id, qos, reason_code)

    def ack_publishes(self, events: Iterable[PublishReceived]) -> None:
        """``ack_publish`` for each of ``events`` with success, in order: the acceptance of
        a batch of publishes.  A 3.1.1 connection's PUBACKs are written in one loop here,
        two calls fewer per message than one ``ack_publish`` each (the QoS 1 stream's path);
        anything else takes ``ack_publish``."""
        if self._v5 is not None or self._qos2_unanswered:
            for event in events:
                self.ack_publish(event.packet_id, event.message.qos)
            return
        if self.state is ConnState.CLOSED and not self._answering:
            return
        out = self._out
        session = self.session
        for message, packet_id in events:
            qos = message.qos
            if not qos or packet_id is None:
                continue
            if qos == 2 and session is not None:
                session.inbound_qos2_acknowledged(packet_id)  # a resend is not routed again
            out += bytes((0x40 if qos == 1 else 0x50, 2, packet_id >> 8, packet_id & 0xFF))

    def _ack_publish(self, packet_id: int, qos: int, reason_code: int) -> None:
        if qos == 2 and reason_code < 0x80 and self.session is not None:
            self.session.inbound_qos2_acknowledged(packet_id)  # a resend is not routed again
        link = self._v5
        if link is not None and (qos == 1 or reason_code >= 0x80):
            link.acked()
        if link is not None and reason_code:
            if qos == 2 and reason_code >= 0x80 and self.session is not None:
                self.session.release_inbound_qos2(packet_id)
            ack = PubAck5(packet_id, reason_code) if qos == 1 else PubRec5(packet_id, reason_code)
            self._out += encode_with_reason(ack, link.problem_info, link.client_max_packet)
            return
        # PUBACK 0x40 / PUBREC 0x50, remaining length 2, the id (one per publish: no
        # packet object on this path).
        self._out += bytes((0x40 if qos == 1 else 0x50, 2, packet_id >> 8, packet_id & 0xFF))

    def send_pingresp(self, ping: PingRequested) -> None:
        """PINGRESP for ``ping``, once: in order behind the answers read before it, or
        sooner when the adapter's bound on that wait ran out."""
        if (self.state is ConnState.CLOSED and not self._answering) or ping.answered:
            return
        ping.answered = True
        self._out += encode_packet(PingResp())

    def send_suback(self, packet_id: int, return_codes: list[int]) -> None:
        """SUBACK; a v5 connection may get any SUBACK reason code (0x8F, 0x9E, 0xA1...),
        which a 3.1.1 one sees as 0x80 failure."""
        if self.state is ConnState.CLOSED and not self._answering:
            return
        link = self._v5
        if link is not None:
            self._out += encode_with_reason(SubAck5(packet_id, tuple(return_codes)),
                                            link.problem_info, link.client_max_packet)
        else:
            codes = tuple(c if c <= 2 else SUBACK_FAILURE for c in return_codes)
            self._out += encode_packet(SubAck(packet_id, codes))

    def send_unsuback(self, packet_id: int, reason_codes: list[int] | None = None) -> None:
        """UNSUBACK; a v5 one carries a reason code per filter (0x11: there was none)."""
        if self.state is ConnState.CLOSED and not self._answering:
            return
        link = self._v5
        if link is not None:
            self._out += encode_with_reason(UnsubAck5(packet_id, tuple(reason_codes or (0,))),
                                            link.problem_info, link.client_max_packet)
        else:
            self._out += encode_packet(UnsubAck(packet_id))
