"""The clients of a fault run: real paho-mqtt 3.1.1 connections, each in its own thread.

Every role records what the checker needs, with ``time.monotonic()`` stamps:

* ``Publisher``: QoS 1 (or QoS 2) stream, payload ``{"p": id, "c": connection no., "s":
  seq}``; every PUBACK (PUBCOMP at QoS 2) is recorded (``on_publish``) with the time it
  came.  One paho client is one TCP
  connection: after a failure a *new* client connects (preferred node first, then the
  others; CONNACK != 0 or no CONNACK means next node), so an unacknowledged message of a dead
  connection is simply never counted as acknowledged.  A connection whose window is full and
  whose oldest message waited ``ACK_TIMEOUT`` is abandoned, as a real client would.
* ``Retainer``: one retained QoS 1 counter per topic, one message in flight at a time, the
  same value re-sent on a new connection until acknowledged.
* ``Subscriber``: persistent (``clean_session=False``) or clean; records each delivery, each
  CONNACK's session-present flag, and (clean) the intervals during which its subscription
  was confirmed by SUBACK and the connection was up.
* ``WillClient``: connects with a will and waits; records when its connection broke.
* ``DualClient``: a client id connected once, then the same id again on another node (the
  two-live-sessions probe).

Nothing here blocks without a bound: connect, SUBACK and PUBACK waits all have timeouts, and
every loop ends on ``stop`` or a deadline.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt

CONNECT_TIMEOUT = 4.0
SUBACK_TIMEOUT = 5.0
ACK_TIMEOUT = 5.0
KEEPALIVE = 5
RETRY_PAUSE = 0.5
#: A client that finds no node accepting it for this long gives up (and is reported).
GIVE_UP = 60.0


class Conn:
    """One paho connection to one node with bounded connect/subscribe waits."""

    def __init__(self, client_id: str, clean: bool, on_message: Any = None,
                 will: tuple[str, bytes] | None = None, keepalive: int = KEEPALIVE) -> None:
        self.paho = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                                clean_session=clean, protocol=mqtt.MQTTv311,
                                reconnect_on_failure=False)
        self.paho.connect_timeout = CONNECT_TIMEOUT
        self.paho.max_inflight_messages_set(1000)
        self.paho.max_queued_messages_set(0)
        if will is not None:
            self.paho.will_set(will[0], will[1], 1, False)
        self.keepalive = keepalive
        self.connack = threading.Event()
        self.rc: int | None = None
        self.session_present = False
        self.closed = threading.Event()
        self.closed_at: float | None = None
        self.closed_by_us = False
        #: Whether ``close(disconnect=True)`` wrote a DISCONNECT (paho closes the socket
        #: right after writing one).
        self.disconnect_sent = False
        self.subacks: dict[int, tuple[float, list[int]]] = {}
        self.suback_event = threading.Condition()
        self.acks: list[tuple[int, float]] = []
        self.ack_event = threading.Event()
        self.node = ""
        self.paho.on_connect = self._on_connect
        self.paho.on_disconnect = self._on_disconnect
        self.paho.on_subscribe = self._on_subscribe
        self.paho.on_publish = self._on_publish
        if on_message is not None:
            self.paho.on_message = on_message
        self.looping = False

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        self.rc = int(rc.value)
        self.session_present = bool(flags.session_present)
        self.connack.set()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, rc: Any,
                       props: Any) -> None:
        if self.closed_at is None:
            self.closed_at = time.monotonic()
        self.closed.set()
        self.connack.set()  # wake a connect() still waiting

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, codes: Any,
                      props: Any) -> None:
        with self.suback_event:
            self.subacks[mid] = (time.monotonic(), [int(c.value) for c in codes])
            self.suback_event.notify_all()

    def _on_publish(self, client: Any, userdata: Any, mid: int, rc: Any, props: Any) -> None:
        # Only an append: paho may hold its own locks here (see Publisher).
        self.acks.append((mid, time.monotonic()))
        self.ack_event.set()

    def connect(self, node: str, address: tuple[str, int]) -> bool:
        """True on CONNACK 0 within the bound; otherwise the connection is closed."""
        self.node = node
        try:
            self.paho.connect(address[0], address[1], self.keepalive)
        except OSError:
            return False
        self.paho.loop_start()
        self.looping = True
        if self.connack.wait(CONNECT_TIMEOUT) and self.rc == 0 and not self.closed.is_set():
            return True
        self.close()
        return False

    def subscribe(self, filters: list[str], qos: int = 1) -> float | None:
        """SUBSCRIBE at ``qos``; the SUBACK time if every filter was granted, else None."""
        rc, mid = self.paho.subscribe([(f, qos) for f in filters])
        if rc != mqtt.MQTT_ERR_SUCCESS:
            return None
        deadline = time.monotonic() + SUBACK_TIMEOUT
        with self.suback_event:
            while mid not in self.subacks:
                left = deadline - time.monotonic()
                if left <= 0 or self.closed.is_set():
                    return None
                self.suback_event.wait(min(left, 0.2))
            t, codes = self.subacks[mid]
        return t if all(c in (0, 1, 2) for c in codes) else None

    def close(self, disconnect: bool = False) -> None:
        self.closed_by_us = True
        # The network thread stops first: paho's thread, finding a keepalive due after
        # ``disconnect()`` set its state but before the DISCONNECT was written, closes the
        # socket without it (observed: a will the broker rightly published, counted as
        # spurious).  With no thread, ``disconnect()`` writes the packet here, at once.
        if self.looping:
            with contextlib.suppress(Exception):
                self.paho.loop_stop()
            self.looping = False
        if disconnect:
            with contextlib.suppress(Exception):
                self.disconnect_sent = (self.paho.disconnect() == mqtt.MQTT_ERR_SUCCESS
                                        and self.paho.socket() is None)
        sock = self.paho.socket()
        if sock is not None:  # no DISCONNECT: the broker must see the TCP connection end
            with contextlib.suppress(OSError):
                sock.close()
        if self.closed_at is None:
            self.closed_at = time.monotonic()
        self.closed.set()


def connect_any(make: Any, order: list[str], addresses: dict[str, tuple[str, int]],
                stop: threading.Event, deadline: float) -> Conn | None:
    """Try ``order`` round-robin until a CONNACK 0, ``stop`` or ``deadline``."""
    while not stop.is_set() and time.monotonic() < deadline:
        for node in order:
            if stop.is_set():
                return None
            conn = make()
            if conn.connect(node, addresses[node]):
                return conn
        stop.wait(RETRY_PAUSE)
    return None


@dataclass
class Delivery:
    t: float
    topic: str
    pub: str
    conn: int
    seq: int
    dup: bool
    retain: bool
    #: The QoS it arrived with (the lower of the publish's and the subscription's).
    qos: int = 1


@dataclass
class Acked:
    pub: str
    conn: int
    seq: int
    topic: str
    t_sent: float
    t_ack: float


class Role(threading.Thread):
    def __init__(self, name: str, order: list[str], addresses: dict[str, tuple[str, int]],
                 stop: threading.Event) -> None:
        super().__init__(name=name, daemon=True)
        self.role_name = name
        self.order = order
        self.addresses = addresses
        self.stop = stop
        self.errors: list[str] = []
        self.connections: list[tuple[str, float]] = []  # (node, CONNACK time)
        self.gave_up: float | None = None  # no node accepted it for GIVE_UP seconds

    def run(self) -> None:
        try:
            self.body()
        except Exception as exc:  # recorded: a harness bug must show in the report
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def body(self) -> None:
        raise NotImplementedError

    def connect_from(self, start: int) -> Conn | None:
        """A clean connection to the first node answering CONNACK 0, trying ``order`` from
        ``start`` round; None (and ``gave_up`` noted) if none did within ``GIVE_UP``."""
        order = self.order[start:] + self.order[:start]
        conn = connect_any(lambda: Conn("", True), order, self.addresses, self.stop,
                           time.monotonic() + GIVE_UP)
        if conn is None:
            if not self.stop.is_set():
                self.gave_up = time.monotonic()
            return None
        self.connections.append((conn.node, time.monotonic()))
        return conn


class Publisher(Role):
    def __init__(self, name: str, order: list[str], addresses: dict[str, tuple[str, int]],
                 stop: threading.Event, topics: list[str], rate: float,
                 window: int = 20, qos: int = 1) -> None:
        super().__init__(name, order, addresses, stop)
        self.topics = topics
        self.qos = qos
        self.interval = 1.0 / rate
        self.window = window
        self.seq = 0
        self.sent: list[tuple[int, str, float]] = []  # all attempts (seq, topic, t)
        self.per_conn: list[tuple[Conn, dict[int, tuple[int, str, float]]]] = []
        self.abandoned = 0

    def body(self) -> None:
        conn_no = 0
        while not self.stop.is_set():
            # after a failed connection, start with the next node: the same node may well
            # answer CONNACK 0 again and stall again (an isolated node does)
            conn = self.connect_from(conn_no % len(self.order))
            if conn is None:
                return
            conn_no += 1
            sent: dict[int, tuple[int, str, float]] = {}
            self.per_conn.append((conn, sent))
            self._stream(conn, conn_no, sent)
            conn.close()

    def _stream(self, conn: Conn, conn_no: int, sent: dict[int, tuple[int, str, float]]
                ) -> None:
        next_t = time.monotonic()
        while not self.stop.is_set() and not conn.closed.is_set():
            next_t += self.interval
            delay = next_t - time.monotonic()
            if delay > 0:
                self.stop.wait(delay)
            else:
                next_t = time.monotonic()
            if len(sent) - len(conn.acks) >= self.window:
                acked = {mid for mid, _ in conn.acks}
                oldest = min((t for mid, (_, _, t) in sent.items() if mid not in acked),
                             default=time.monotonic())
                if time.monotonic() - oldest > ACK_TIMEOUT:
                    self.abandoned += 1
                    return
                conn.ack_event.clear()
                conn.ack_event.wait(0.2)
                continue
            self.seq += 1
            topic = self.topics[self.seq % len(self.topics)]
            payload = json.dumps({"p": self.role_name, "c": conn_no, "s": self.seq}).encode()
            t = time.monotonic()
            info = conn.paho.publish(topic, payload, self.qos)
            if info.rc != mqtt.MQTT_ERR_SUCCESS:
                return
            sent[info.mid] = (self.seq, topic, t)
            self.sent.append((self.seq, topic, t))

    def drain(self, timeout: float) -> None:
        """After ``stop``: wait (bounded) for the last connection's outstanding PUBACKs."""
        deadline = time.monotonic() + timeout
        if not self.per_conn:
            return
        conn, sent = self.per_conn[-1]
        while len(conn.acks) < len(sent) and time.monotonic() < deadline \
                and not conn.closed.is_set():
            conn.ack_event.clear()
            conn.ack_event.wait(0.1)

    def acked(self) -> list[Acked]:
        out = []
        for conn_no, (conn, sent) in enumerate(self.per_conn, start=1):
            for mid, t_ack in list(conn.acks):
                if mid in sent:
                    seq, topic, t_sent = sent[mid]
                    out.append(Acked(self.role_name, conn_no, seq, topic, t_sent, t_ack))
        return out


class Retainer(Role):
    def __init__(self, name: str, order: list[str], addresses: dict[str, tuple[str, int]],
                 stop: threading.Event, topic: str, rate: float = 5.0) -> None:
        super().__init__(name, order, addresses, stop)
        self.topic = topic
        self.interval = 1.0 / rate
        self.value = 0
        self.acked: list[tuple[int, float]] = []  # (value, t_ack)

    def body(self) -> None:
        self.value = 1
        while not self.stop.is_set():
            # the next node after a failure
            conn = self.connect_from(len(self.connections) % len(self.order))
            if conn is None:
                return
            try:
                while not self.stop.is_set() and not conn.closed.is_set():
                    info = conn.paho.publish(self.topic, str(self.value).encode(), 1,
                                             retain=True)
                    if info.rc != mqtt.MQTT_ERR_SUCCESS:
                        break
                    deadline = time.monotonic() + ACK_TIMEOUT
                    while not info.is_published() and time.monotonic() < deadline \
                            and not conn.closed.is_set():
                        conn.ack_event.clear()
                        conn.ack_event.wait(0.1)
                    if not info.is_published():
                        break  # same value again, on a new connection
                    self.acked.append((self.value, time.monotonic()))
                    self.value += 1
                    self.stop.wait(self.interval)
            finally:
                conn.close()


class Subscriber(Role):
    """At ``qos`` 2 a persistent subscriber is the exactly-once probe: paho hands a QoS 2
    message over when its PUBREL comes (method A of MQTT's figure 4.3) and keeps the ones
    still awaiting a PUBREL in its session state, which this role carries from one
    connection's client to the next (``_qos2_state``), as a client with clean session 0
    must: paho itself keeps it only within one ``Client``."""

    def __init__(self, name: str, order: list[str], addresses: dict[str, tuple[str, int]],
                 stop: threading.Event, filters: list[str], clean: bool,
                 qos: int = 1) -> None:
        super().__init__(name, order, addresses, stop)
        self.filters = filters
        self.clean = clean
        self.qos = qos
        #: paho's inbound QoS 2 messages awaiting PUBREL, shared by this role's clients.
        self._qos2_state: Any = None
        self.deliveries: list[Delivery] = []
        self.other: list[tuple[float, str, bytes]] = []  # non-data topics (wills)
        #: [SUBACK time, closed time, 1.0 if we closed it at the end]
        self.intervals: list[list[float | None]] = []
        self.first_suback: float | None = None
        self.session_lost: list[float] = []  # CONNACK without the session we had
        self.conn: Conn | None = None
        self.ready = threading.Event()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        t = time.monotonic()
        try:
            body = json.loads(msg.payload)
            self.deliveries.append(Delivery(t, msg.topic, body["p"], int(body["c"]),
                                            int(body["s"]), bool(msg.dup), bool(msg.retain),
                                            int(msg.qos)))
        except (ValueError, KeyError, TypeError):
            self.other.append((t, msg.topic, bytes(msg.payload)))

    def body(self) -> None:
        while not self.stop.is_set():
            conn = connect_any(self._new_conn, self.order, self.addresses, self.stop,
                               time.monotonic() + GIVE_UP)
            if conn is None:
                if not self.stop.is_set():
                    self.gave_up = time.monotonic()
                return
            self.conn = conn
            self.connections.append((conn.node, time.monotonic()))
            if self.first_suback is not None and not self.clean and not conn.session_present:
                self.session_lost.append(time.monotonic())
            if self.clean or self.first_suback is None or not conn.session_present:
                t_sub = conn.subscribe(self.filters, self.qos)
                if t_sub is None:
                    conn.close()
                    continue
                if self.first_suback is None:
                    self.first_suback = t_sub
                interval: list[float | None] = [t_sub, None, None]
            else:
                interval = [time.monotonic(), None, None]
            self.intervals.append(interval)
            self.ready.set()
            while not self.stop.is_set() and not conn.closed.wait(0.2):
                pass
            if self.stop.is_set() and not conn.closed.is_set():
                conn.close(disconnect=True)
                interval[1], interval[2] = time.monotonic(), 1.0  # ended by us
                self.conn = None
                return
            interval[1] = conn.closed_at
            conn.close()
            self.conn = None


    def _new_conn(self) -> Conn:
        conn = Conn(self.role_name, self.clean, self._on_message)
        if not self.clean:
            # The previous clients are closed (their loops stopped) before this one starts.
            if self._qos2_state is None:
                self._qos2_state = conn.paho._in_messages
            else:
                conn.paho._in_messages = self._qos2_state
        return conn


class WillClient(Role):
    """Connects once with a will and stays; never reconnects (the will is what we watch)."""

    def __init__(self, name: str, node: str, addresses: dict[str, tuple[str, int]],
                 stop: threading.Event, will_topic: str) -> None:
        super().__init__(name, [node], addresses, stop)
        self.node = node
        self.will_topic = will_topic
        self.broken_at: float | None = None
        self.disconnect_sent = False
        self.connected = threading.Event()
        self.conn: Conn | None = None

    def body(self) -> None:
        conn = connect_any(lambda: Conn(self.role_name, True, None,
                                        (self.will_topic, self.role_name.encode()), 3),
                           self.order, self.addresses, self.stop, time.monotonic() + 20)
        if conn is None:
            self.errors.append("could not connect")
            return
        self.conn = conn
        self.connected.set()
        while not self.stop.is_set() and not conn.closed.wait(0.2):
            pass
        if conn.closed.is_set() and not conn.closed_by_us:
            self.broken_at = conn.closed_at
        conn.close(disconnect=True)  # a clean DISCONNECT: no will from here
        self.disconnect_sent = conn.disconnect_sent


@dataclass
class DualProbe:
    """Same client id, first on ``first_node``, later on a node of ``second_nodes``."""

    client_id: str
    clean: bool
    first_node: str
    second_nodes: list[str]
    first: Conn | None = None
    second: Conn | None = None
    second_at: float | None = None
    refusals: int = 0
    notes: list[str] = field(default_factory=list)

    def connect_first(self, addresses: dict[str, tuple[str, int]]) -> bool:
        conn = Conn(self.client_id, self.clean)
        ok = conn.connect(self.first_node, addresses[self.first_node])
        if ok and not self.clean:
            conn.subscribe([f"mqf/dual/{self.client_id}"])
        self.first = conn if ok else None
        return ok

    def try_second(self, addresses: dict[str, tuple[str, int]]) -> bool:
        """One attempt on each candidate node; True once a CONNACK 0 came."""
        for node in self.second_nodes:
            conn = Conn(self.client_id, self.clean)
            if conn.connect(node, addresses[node]):
                self.second, self.second_at = conn, time.monotonic()
                return True
            self.refusals += 1
        return False

    def close(self) -> None:
        for conn in (self.first, self.second):
            if conn is not None:
                conn.close(disconnect=False)
