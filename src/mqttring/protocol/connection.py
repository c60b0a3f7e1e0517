"""The server side of one MQTT 3.1.1 or 5.0 network connection, without I/O.

A level-5 CONNECT turns on the connection's MQTT 5.0 half (``connection5.V5Link``: the v5
decoder, topic aliases, flow control, CONNACK properties, DISCONNECT with a reason code);
the 3.1.1 paths below never consult it except where the answer differs (CONNACK, SUBACK,
UNSUBACK, refusals, the DISCONNECT sent before closing on a protocol error).

Theory of operation
-------------------
Shaped like h11's ``Connection``: the adapter feeds received bytes to ``receive_data``, which
returns the *events* the broker must act on, and drains ``data_to_send()`` into the socket.
Everything the protocol can answer by itself (PUBREL/PUBCOMP handshakes, PUBREC for a
redelivered QoS 2 PUBLISH, CONNACK refusals with codes 1 and 2) is answered here; what
needs the rest of the broker (routing, subscriptions, takeover, authentication) becomes an
event, and the broker answers through ``accept``/``refuse`` and the answering half,
``answers.Answers`` (``ack_publish``, ``send_suback``, ...).
A PINGREQ is an event too (``PingRequested``): its PINGRESP must not overtake the answers
to the packets before it, which only the broker knows are due.

States: ``AWAIT_CONNECT`` -> ``CONNECTING`` (CONNECT seen, broker deciding) -> ``CONNECTED``
-> ``CLOSED``.  Any byte that violates the protocol raises an ``MQTTError``; the adapter then
closes the connection (the will is published, since that is not a DISCONNECT).  After
``CLOSED`` the machine accepts nothing more: the adapter flushes and closes the socket.  A
``CLOSED`` reached by the client's DISCONNECT still answers the packets read before it (the
broker handles them, in order, before it closes), as mosquitto does.

Packets received while the broker is still deciding on a CONNECT are buffered by the decoder
and handed out once the connection is accepted, so pipelining clients (CONNECT immediately
followed by SUBSCRIBE) behave.

The session (``Session``) is separate: it survives this connection when CleanSession=0.
"""

from __future__ import annotations

from collections.abc import Callable

from mqttring.protocol.answers import Answers
from mqttring.protocol.codec import PacketDecoder
from mqttring.protocol.codec import encode as encode_packet
from mqttring.protocol.codec5 import PacketDecoder5
from mqttring.protocol.connection5 import (
    DEFAULT_LIMITS5,
    NO_KEEPALIVE_LIMIT,
    ServerLimits5,
    V5Link,
    keepalive_refused,
)
from mqttring.protocol.decoder5 import ConnectRefused5
from mqttring.protocol.errors import MQTTError, ProtocolViolation
from mqttring.protocol.events import (
    ConnectRequested,
    ConnState,
    DisconnectRequested,
    Event,
    PingRequested,
    PublishReceived,
    SubscribeRequested,
    UnsubscribeRequested,
)
from mqttring.protocol.message import Message
from mqttring.protocol.packets import (
    ConnAck,
    Connect,
    ConnectReturnCode,
    Disconnect,
    PingReq,
    PubAck,
    PubComp,
    PubRec,
    PubRel,
    Subscribe,
    Unsubscribe,
)
from mqttring.protocol.packets5 import (
    ConnAck5,
    Connect5,
    Disconnect5,
)
from mqttring.protocol.properties import (
    VALID_REASONS,
    PropertyId,
    ReasonCode,
)
from mqttring.protocol.reasons5 import encode_with_reason
from mqttring.protocol.session import Session

_PROTOCOLS = {("MQTT", 4), ("MQIsdp", 3)}

#: What ``_drain_connected``'s decoder handlers return for a packet that is dealt with and
#: makes no event: a PUBACK applied to the session, a QoS 2 redelivery answered with PUBREC.
_APPLIED = object()
_ANSWERED = object()

#: The v5 reason code for each 3.1.1 CONNACK refusal the broker core decides on.
_V5_REFUSALS = {
    ConnectReturnCode.UNACCEPTABLE_PROTOCOL_VERSION: ReasonCode.UNSUPPORTED_PROTOCOL_VERSION,
    ConnectReturnCode.IDENTIFIER_REJECTED: ReasonCode.CLIENT_IDENTIFIER_NOT_VALID,
    ConnectReturnCode.SERVER_UNAVAILABLE: ReasonCode.SERVER_UNAVAILABLE,
    ConnectReturnCode.BAD_USERNAME_OR_PASSWORD: ReasonCode.BAD_USER_NAME_OR_PASSWORD,
    ConnectReturnCode.NOT_AUTHORIZED: ReasonCode.NOT_AUTHORIZED,
}


class ServerConnection(Answers):
    """Sans-IO protocol machine for one client connection."""

    __slots__ = (
        "_answering",
        "_decoder",
        "_freed",
        "_out",
        "_qos2_unanswered",
        "_v5",
        "client_id",
        "connect",
        "disconnected",
        "limits5",
        "max_client_id_bytes",
        "max_keepalive",
        "packets_received",
        "protocol_error",
        "publishes_received",
        "session",
        "state",
    )

    def __init__(self, max_packet_size: int = 268_435_455,
                 limits5: ServerLimits5 = DEFAULT_LIMITS5,
                 max_keepalive: int = NO_KEEPALIVE_LIMIT,
                 max_client_id_bytes: int = 65535) -> None:
        self._decoder: PacketDecoder = PacketDecoder(max_packet_size,
                                                     limits5.max_user_properties)
        #: The MQTT 5.0 side of the connection once a v5 CONNECT arrived; None: 3.1.1.
        self._v5: V5Link | None = None
        self.limits5 = limits5
        #: Longest keep alive a client may ask for (``max_keepalive``; 65535: any).
        self.max_keepalive = max_keepalive
        #: Longest client id accepted, in UTF-8 bytes (``limits.max_client_id_bytes``).
        self.max_client_id_bytes = max_client_id_bytes
        #: An acknowledgement in the current read freed a window slot (``_drain`` refills).
        self._freed = False
        self._out = bytearray()
        #: Packet ids of the QoS 2 PUBLISHes handed to the core and not yet answered
        #: (PUBREC), in the order read, each with the answers held behind it (``hold``).
        self._qos2_unanswered: dict[int, list[tuple[int, bool]] | None] | None = None
        self.state = ConnState.AWAIT_CONNECT
        self.connect: Connect | Connect5 | None = None
        self.client_id: str | None = None
        self.session: Session | None = None
        #: The client sent DISCONNECT: closed for input, but what it sent before is still
        #: to be handled (unlike a connection closed by the broker).
        self.disconnected = False
        #: Closed by that DISCONNECT and by nothing else since: the answers to the packets
        #: before it (PUBACK, SUBACK, PINGRESP...) are still written, in order, as the
        #: broker handles them; a close by the broker (``close``, ``disconnect``) ends that.
        self._answering = False
        #: The rule broken by bytes that came in the same read as the CONNECT, found while
        #: accepting it (``accept``): the connection is closed, and its handler says why.
        self.protocol_error: MQTTError | None = None
        self.packets_received = 0
        self.publishes_received = 0

    # -- input ------------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> list[Event]:
        """Feed bytes from the peer; returns what the broker must act on, in order."""
        if self.state is ConnState.CLOSED:
            return []
        self._decoder.feed(data)
        try:
            return self._drain()
        except MQTTError as exc:
            if self._v5 is not None and self.state is ConnState.CONNECTED:
                # MQTT 5: say why before closing [MQTT-4.13.1-1], and which rule.
                self.disconnect(exc.reason_code, str(exc))
            elif (self.state is ConnState.AWAIT_CONNECT
                  and exc.reason_code == ReasonCode.UNSUPPORTED_PROTOCOL_VERSION):
                # A CONNECT under MQTT 3.1's name with another level than 3 (the decoder
                # parses no further): CONNACK 1, then the close [MQTT-3.1.2-2], as mosquitto
                # answers it and as the other unsupported levels are answered (``refuse``).
                self.refuse(ConnectReturnCode.UNACCEPTABLE_PROTOCOL_VERSION)
            elif self.state is ConnState.AWAIT_CONNECT and isinstance(exc, ConnectRefused5):
                # A v5 CONNECT refused as it was decoded (too many user properties, 0x97;
                # Authentication Data without a method, 0x82): say why [MQTT-3.2.2-7].
                self._out += encode_with_reason(ConnAck5(False, exc.reason_code), True, 0,
                                                exc.detail)
                self.state = ConnState.CLOSED
            raise

    @property
    def v5(self) -> V5Link | None:
        """The MQTT 5.0 state of this connection; None while it speaks 3.1.1."""
        return self._v5

    @property
    def protocol_level(self) -> int:
        return 5 if self._v5 is not None else 4

    def freed(self) -> None:
        """An acknowledgement freed an inflight slot (refilled once per read)."""
        self._freed = True

    def count_publish(self, event: PublishReceived | None) -> PublishReceived | None:
        self.publishes_received += 1
        return event

    def closed_by_client(self) -> None:
        """The client sent DISCONNECT: closed for input; what it sent before still counts,
        and is still answered (``_answering``): a client that wrote a PUBLISH and its
        DISCONNECT at once got no PUBACK, where mosquitto sends it."""
        self.state = ConnState.CLOSED
        self.disconnected = True
        self._answering = True

    def disconnect(self, reason_code: int, detail: str | None = None) -> None:
        """MQTT 5: send DISCONNECT with a reason (and a reason string: ``detail``, or the
        code's text) and stop (server-initiated disconnect).  On a 3.1.1 connection
        (which has no server DISCONNECT) it only closes."""
        link = self._v5
        if link is not None and self.state is not ConnState.CLOSED:
            if reason_code not in VALID_REASONS["DISCONNECT"]:
                reason_code = 0x80  # a reason a DISCONNECT may carry
            self._out += encode_with_reason(Disconnect5(reason_code), True,
                                            link.client_max_packet, detail)
        self.state = ConnState.CLOSED
        self._answering = False

    def _drain(self) -> list[Event]:
        events: list[Event] = []
        decoder = self._decoder
        self._freed = False
        try:
            self._drain_into(events, decoder)
        finally:
            if self._freed:
                # Acknowledgements freed window slots: refill once for the whole read.
                assert self.session is not None
                self.session.pump()
        return events

    def _drain_into(self, events: list[Event], decoder: PacketDecoder) -> None:
        while self.state is not ConnState.CONNECTING and self.state is not ConnState.CLOSED:
            if self.state is ConnState.CONNECTED and self._v5 is None:
                if self._drain_connected(events, decoder):
                    continue  # a packet changed the state (DISCONNECT): look again
                break
            # Before CONNECT is decided, and every packet of an MQTT 5 connection (its
            # decoder builds v5 packets, handled by ``_on_packet`` and ``V5Link``).
            packet = decoder.next_packet()
            if packet is None:
                break
            self.packets_received += 1
            event = self._on_packet(packet)
            if event is not None:
                events.append(event)

    def _drain_connected(self, events: list[Event], decoder: PacketDecoder) -> bool:
        """The open 3.1.1 connection's loop: a PUBLISH becomes its event and a PUBACK is
        applied straight from the decoder's fields (``next_packet``'s handlers), the rest
        as in ``_drain_into``.  True once the state changed, False when bytes are needed."""
        next_packet = decoder.next_packet
        on_publish = self._publish_event
        on_puback = self._puback
        append = events.append
        packets = publishes = 0
        try:
            while True:
                item = next_packet(on_publish, on_puback)
                if item is None:
                    return False
                packets += 1
                if type(item) is PublishReceived:
                    publishes += 1
                    append(item)
                elif item is _APPLIED:
                    continue
                elif item is _ANSWERED:
                    publishes += 1
                else:
                    event = self._on_packet(item)
                    if event is not None:
                        append(event)
                    if self.state is not ConnState.CONNECTED or self._v5 is not None:
                        return True
        finally:
            self.packets_received += packets
            self.publishes_received += publishes

    def _publish_event(self, topic: str, payload: bytes, qos: int, retain: bool,
                       packet_id: int | None) -> PublishReceived | object:
        if qos == 2:
            assert self.session is not None and packet_id is not None
            mid = self.session.begin_inbound_qos2(packet_id)
            if not mid:
                # Redelivery of a message we already own: acknowledge, do not route again.
                if not self.hold(packet_id, False):
                    self._out += encode_packet(PubRec(packet_id))
                return _ANSWERED
            self.qos2_read(packet_id)
            return PublishReceived(Message(topic, payload, 2, retain, None, mid), packet_id)
        return PublishReceived(Message(topic, payload, qos, retain), packet_id)

    def _puback(self, packet_id: int) -> object:
        assert self.session is not None
        if self.session.on_puback(packet_id, pump=False):
            self._freed = True
        return _APPLIED

    def _on_packet(self, packet: object) -> Event | None:
        if self.state is ConnState.AWAIT_CONNECT:
            if type(packet) is Connect5:
                return self._on_connect5(packet)
            if not isinstance(packet, Connect):
                raise ProtocolViolation(
                    "MQTT-3.1.0-1", f"first packet must be CONNECT, got {type(packet).__name__}"
                )
            return self._on_connect(packet)
        session = self.session
        assert session is not None
        if isinstance(packet, PubAck):
            if session.on_puback(packet.packet_id, pump=False):
                self._freed = True
        elif isinstance(packet, PubRec):
            session.on_pubrec(packet.packet_id)
        elif isinstance(packet, PubComp):
            if session.on_pubcomp(packet.packet_id, pump=False):
                self._freed = True
        elif isinstance(packet, PubRel):
            if not self.hold(packet.packet_id, True):
                session.release_inbound_qos2(packet.packet_id)
                self._out += encode_packet(PubComp(packet.packet_id))
        elif isinstance(packet, PingReq):
            return PingRequested()
        elif isinstance(packet, Subscribe):
            return SubscribeRequested(packet.packet_id, packet.topics)
        elif isinstance(packet, Unsubscribe):
            return UnsubscribeRequested(packet.packet_id, packet.topics)
        elif isinstance(packet, Disconnect):
            self.closed_by_client()
            return DisconnectRequested()
        elif isinstance(packet, Connect):
            raise ProtocolViolation("MQTT-3.1.0-2", "a second CONNECT on one connection")
        elif self._v5 is not None:
            return self._v5.on_packet(self, packet)
        else:
            raise ProtocolViolation(
                "MQTT-4.8.0-1", f"{type(packet).__name__} is only sent by servers"
            )
        return None

    def _on_connect(self, packet: Connect) -> ConnectRequested | None:
        self.connect = packet
        if (packet.protocol_name, packet.protocol_level) not in _PROTOCOLS:
            # [MQTT-3.1.2-2]: answer code 1, then close.
            self.refuse(ConnectReturnCode.UNACCEPTABLE_PROTOCOL_VERSION)
            return None
        if packet.protocol_level == 3:
            if not packet.client_id:
                # MQTT 3.1 has no server-assigned ids (new in 3.1.1): its client id is 1 to
                # 23 characters, so an empty one is refused whatever CleanSession says, as
                # mosquitto refuses it (a longer one is left to ``max_client_id_bytes``).
                self.refuse(ConnectReturnCode.IDENTIFIER_REJECTED)
                return None
            self._decoder.speak_mqtt31()
        if not packet.client_id and not packet.clean_session:
            # [MQTT-3.1.3-8]
            self.refuse(ConnectReturnCode.IDENTIFIER_REJECTED)
            return None
        if keepalive_refused(packet.keepalive, self.max_keepalive):
            # 3.1.1 has no Server Keep Alive: refused as mosquitto does (max_keepalive).
            self.refuse(ConnectReturnCode.IDENTIFIER_REJECTED)
            return None
        if self._client_id_too_long(packet.client_id):
            # The server MAY refuse client ids longer than 23 bytes [MQTT-3.1.3-5].
            self.refuse(ConnectReturnCode.IDENTIFIER_REJECTED)
            return None
        self.state = ConnState.CONNECTING
        return ConnectRequested(packet)

    def _client_id_too_long(self, client_id: str) -> bool:
        limit = self.max_client_id_bytes
        return len(client_id) > limit // 4 and len(client_id.encode("utf-8")) > limit

    def _on_connect5(self, packet: Connect5) -> ConnectRequested | None:
        self.connect = packet
        self._v5 = V5Link(packet, self.limits5, max_keepalive=self.max_keepalive)
        # What follows the CONNECT is MQTT 5: continue on the v5 decoder.
        self._decoder = PacketDecoder5.take_over(self._decoder,
                                                 self.limits5.max_user_properties)
        if PropertyId.AUTHENTICATION_METHOD in packet.properties:
            # Enhanced authentication (section 4.12): no method is supported here.
            self.refuse_v5(ReasonCode.BAD_AUTHENTICATION_METHOD)
            return None
        if self._client_id_too_long(packet.client_id):
            self.refuse_v5(ReasonCode.CLIENT_IDENTIFIER_NOT_VALID)
            return None
        self.state = ConnState.CONNECTING
        return ConnectRequested(packet)

    # -- broker decisions -------------------------------------------------------------------

    def accept(self, session: Session, session_present: bool, now: float = 0.0) -> list[Event]:
        """Send CONNACK 0, bind the session (resending its inflight messages).

        ``now`` is wall-clock UNIX seconds: it only decides which queued messages expired
        while the client was away (``Session.attach``), never keepalive timing.

        Returns events for packets that arrived pipelined behind the CONNECT.
        """
        if self.state is not ConnState.CONNECTING:
            raise RuntimeError(f"accept() in state {self.state}")
        self.state = ConnState.CONNECTED
        self.session = session
        self.client_id = session.client_id
        # [MQTT-3.2.2-1]: session present is 0 for a clean session.
        present = session_present and not session.clean_session
        if present and self.connect is not None and self.connect.protocol_level == 3:
            present = False  # MQTT 3.1 has no such flag: that byte is reserved, 0
        if self._v5 is None:
            self._out += encode_packet(ConnAck(present, ConnectReturnCode.ACCEPTED))
        else:
            assert self.connect is not None
            connack = self._v5.connack(present, self.connect, session.client_id,
                                       self._decoder.max_packet_size)
            if connack is None:
                # What the client must be told does not fit its own limit: it gets no
                # CONNACK and the connection closes, as mosquitto does [MQTT-3.1.2-24].
                self.protocol_error = ProtocolViolation(
                    "MQTT-3.1.2-24", "the CONNACK does not fit the client's Maximum Packet "
                    f"Size ({self._v5.client_max_packet} bytes)")
                self.state = ConnState.CLOSED
                return []
            self._out += connack
        session.attach(self._out, now)
        try:
            return self._drain()
        except MQTTError as exc:
            # Bytes that arrived behind the CONNECT (one TCP segment, say) broke a rule: the
            # same close as when they come in a later read (``receive_data``), after the
            # CONNACK, never an error escaping to the caller.
            self.protocol_error = exc
            self.disconnect(exc.reason_code, str(exc))
            return []

    def refuse(self, code: ConnectReturnCode) -> None:
        """Send CONNACK with a non-zero code [MQTT-3.2.2-4] and close [MQTT-3.2.2-5]."""
        if self._v5 is not None:
            self.refuse_v5(_V5_REFUSALS[code])
            return
        self._out += encode_packet(ConnAck(False, code))
        self.state = ConnState.CLOSED

    def refuse_v5(self, reason_code: int) -> None:
        """MQTT 5: CONNACK with a failure reason code and a reason string, then close
        [MQTT-3.2.2-7]."""
        assert self._v5 is not None
        self._out += encode_with_reason(ConnAck5(False, reason_code), True,
                                        self._v5.client_max_packet)
        self.state = ConnState.CLOSED

    def close(self) -> None:
        """Stop accepting input and answering it (after a violation, takeover or shutdown)."""
        self.state = ConnState.CLOSED
        self._answering = False

    # -- output -----------------------------------------------------------------------------

    @property
    def output(self) -> bytearray:
        """The live output buffer; the session appends deliveries to it directly."""
        return self._out

    def data_to_send(self) -> bytes:
        if not self._out:
            return b""
        data = bytes(self._out)
        self._out.clear()
        return data

    def send_into(self, send: Callable[[memoryview], int]) -> int:
        """Hand the pending output to ``send`` (a non-blocking write: returns how much it
        took); what it did not take stays pending, in order.  Returns the bytes taken."""
        out = self._out
        with memoryview(out) as view:
            taken = send(view)
        del out[:taken]
        return taken

    @property
    def pending_output(self) -> int:
        return len(self._out)

    @property
    def keepalive(self) -> int:
        """The keep-alive in force: the client's (the same field in 3.1.1 and 5.0), or the
        Server Keep Alive a v5 CONNACK announced [MQTT-3.2.2-21]."""
        if self._v5 is not None:
            return self._v5.keepalive
        return self.connect.keepalive if self.connect is not None else 0

    @property
    def closed(self) -> bool:
        return self.state is ConnState.CLOSED
