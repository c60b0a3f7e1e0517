"""The load generator: worker processes that speak MQTT over raw sockets.

Why its own generator: paho-mqtt tops out far below mosquitto, so a benchmark driven by it
measures paho.  Here every packet is encoded before the clock starts, a batch of PUBLISH
frames leaves in one ``sendall``, and readers walk frames without decoding them
(``benchmarks.wire``).  Whether that is fast enough is itself measured: ``benchmarks.sink``
points the same workers at a server that only discards or floods, and the report prints
that ceiling next to the broker figures.

Shape of a run (driven by ``benchmarks.scenarios``):

* Workers are ``multiprocessing`` processes (spawn context: the parent may be running a
  broker in a thread, and forking a threaded process is unsafe).  Each owns one slot of
  ``SLOT`` int64 counters in a shared ``RawArray``; it writes only its own slot, so no
  locks are needed, and everybody reads everybody's.
* ``ctl[PHASE]`` moves SETUP -> GO -> STOP -> DONE under the orchestrator's control.  A
  worker sets ``READY`` once connected (and subscribed), and ``ERROR`` if it failed; details
  go to the result queue.
* Closed loop: a publisher only sends while the messages in flight across the whole
  scenario (sent x fan-out factor - received, in messages) stay under a window, so no
  broker is ever flooded into dropping.  If deliveries stop for ``stall_s`` while the window
  is full (a broker that drops QoS 0), the publisher writes the outstanding messages off
  and counts a stall; they show up as loss at the end.
* Every loop is bounded by a message count and a deadline.
"""

from __future__ import annotations

import contextlib
import resource
import select
import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks import wire

SETUP, GO, STOP, DONE = 0, 1, 2, 3
PHASE = 0
#: Counters in each worker's slot.
READY, SENT, RECV, ACKED, WRITEOFF, DUPS, STALLS, ERROR = range(8)
SLOT = 8
HEADER = 8


def slot_base(worker: int) -> int:
    return HEADER + SLOT * worker


def raise_nofile() -> int:
    """Raise the soft fd limit to the hard one (idle-connection scenarios need ~10k fds)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@dataclass
class WorkerSpec:
    """Everything a worker needs; picklable so it crosses the spawn boundary."""

    role: str
    index: int
    host: str
    port: int
    client_prefix: str
    topics: list[str] = field(default_factory=list)
    filters: list[list[str]] = field(default_factory=list)
    qos: int = 0
    payload_size: int = 64
    batch: int = 32
    window: int = 1000
    inflight: int = 100
    fanout: int = 1
    pub_slots: list[int] = field(default_factory=list)
    sub_slots: list[int] = field(default_factory=list)
    max_msgs: int = 10_000_000
    max_seconds: float = 30.0
    open_loop: bool = False
    stall_s: float = 1.0
    rate: float = 200.0
    connections: int = 0
    connect_timeout: float = 10.0


class ProtocolFailure(Exception):
    """The broker answered something a correct broker would not (or nothing in time)."""


def open_conn(
    host: str, port: int, client_id: str, timeout: float = 10.0
) -> tuple[socket.socket, bytearray]:
    """Blocking connect + CONNECT/CONNACK; returns the socket and any bytes read past CONNACK."""
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(wire.connect(client_id))
    buf = bytearray()
    first, body, end = read_frame(sock, buf, timeout)
    if first != wire.CONNACK or buf[body + 1] != 0:
        raise ProtocolFailure(f"{client_id}: expected CONNACK 0, got {bytes(buf[:end])!r}")
    del buf[:end]
    sock.settimeout(None)  # blocking from here on: MSG_DONTWAIT and select do the polling
    return sock, buf


def read_frame(sock: socket.socket, buf: bytearray, timeout: float) -> tuple[int, int, int]:
    """Read until ``buf`` starts with a complete frame (bounded by ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        frame = wire.next_frame(buf, 0, len(buf))
        if frame is not None:
            sock.settimeout(None)
            return frame
        left = deadline - time.monotonic()
        if left <= 0:
            raise ProtocolFailure("timed out waiting for a packet from the broker")
        sock.settimeout(left)
        chunk = sock.recv(65536)
        if not chunk:
            raise ProtocolFailure("broker closed the connection")
        buf += chunk


def subscribe(
    sock: socket.socket, buf: bytearray, filters: list[str], qos: int, timeout: float
) -> None:
    """SUBSCRIBE in chunks of 100 filters and wait for each SUBACK; a 0x80 code is a failure."""
    held = bytearray()
    for pid, start in enumerate(range(0, len(filters), 100), start=1):
        chunk = filters[start : start + 100]
        sock.sendall(wire.subscribe(pid, chunk, qos))
        while True:
            first, body, end = read_frame(sock, buf, timeout)
            if first == wire.SUBACK:
                codes = bytes(buf[body + 2 : end])
                del buf[:end]
                if 0x80 in codes:
                    raise ProtocolFailure(f"SUBACK refused a filter: {codes!r}")
                break
            if first & 0xF0 != wire.PUBLISH:
                raise ProtocolFailure(f"expected SUBACK, got packet type {first >> 4}")
            # A retained PUBLISH may arrive before SUBACK: keep it, in order, for the reader.
            held += buf[:end]
            del buf[:end]
    buf[:0] = held


class Worker:
    """Shared-counter helpers for one worker process."""

    def __init__(self, spec: WorkerSpec, ctl: Any) -> None:
        self.spec = spec
        self.ctl = ctl
        self.base = slot_base(spec.index)
        self.deadline = time.monotonic() + spec.max_seconds

    def set(self, counter: int, value: int) -> None:
        self.ctl[self.base + counter] = value

    def total(self, slots: list[int], counter: int) -> int:
        ctl = self.ctl
        return sum(ctl[slot_base(s) + counter] for s in slots)

    def wait_phase(self, phase: int) -> bool:
        """Wait (bounded) until the orchestrator reaches ``phase``; False on timeout/abort."""
        while self.ctl[PHASE] < phase:
            if time.monotonic() > self.deadline:
                return False
            time.sleep(0.002)
        return True


def run_worker(spec: WorkerSpec, ctl: Any, results: Any) -> None:
    """Process entry point: dispatch on role, always report (result or error) on the queue."""
    raise_nofile()
    w = Worker(spec, ctl)
    try:
        fn = {
            "pub": publisher,
            "sub": subscriber,
            "latency": latency,
            "idle": idle_connections,
            "retained": retained,
        }[spec.role]
        out = fn(w)
        results.put({"index": spec.index, "role": spec.role, "ok": True, **out})
    except Exception as exc:  # reported to the orchestrator, which fails the scenario
        w.set(ERROR, 1)
        results.put(
            {
                "index": spec.index,
                "role": spec.role,
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
            }
        )


def _qos1_batches(spec: WorkerSpec, body: bytes) -> list[bytes]:
    """Every packet id 1..65535 pre-encoded, so a QoS 1 batch is a slice and a join."""
    topic = spec.topics[0]
    return [b""] + [wire.publish(topic, body, 1, pid) for pid in range(1, 65536)]


def publisher(w: Worker) -> dict[str, Any]:
    """One connection publishing pre-encoded batches, closed loop unless ``open_loop``."""
    spec = w.spec
    sock, _ = open_conn(
        spec.host, spec.port, f"{spec.client_prefix}-p{spec.index}", spec.connect_timeout
    )
    body = wire.payload(spec.payload_size)
    n = spec.batch
    if spec.qos == 0:
        # Cycle topics over a ring of pre-joined batches (wildcard scenario uses 1,000 topics).
        topics = spec.topics
        frames = [wire.publish(t, body) for t in topics]
        nb = max(1, len(frames) // n) if len(frames) > n else 1
        batches = [b"".join(frames[(b * n + k) % len(frames)] for k in range(n)) for b in range(nb)]
        pkts: list[bytes] = []
    else:
        pkts = _qos1_batches(spec, body)
        batches = []
    w.set(READY, 1)
    if not w.wait_phase(GO):
        raise ProtocolFailure("never told to start")
    sent = acked = writeoff = stalls = 0
    pid = 1
    rbuf = bytearray(1 << 16)
    have = 0
    fanout = spec.fanout
    last_recv = -1
    last_progress = time.monotonic()
    bi = 0
    ctl = w.ctl
    while ctl[PHASE] == GO and sent < spec.max_msgs:
        now = time.monotonic()
        if now > w.deadline:
            break
        if spec.qos:
            # Drain PUBACKs without blocking.
            try:
                got = sock.recv_into(memoryview(rbuf)[have:], len(rbuf) - have, socket.MSG_DONTWAIT)
            except BlockingIOError:
                got = -1
            if got == 0:
                raise ProtocolFailure("broker closed the publisher connection")
            if got > 0:
                have += got
                k, used = wire.count_acks(rbuf, 0, have)
                acked += k
                rbuf[: have - used] = rbuf[used:have]
                have -= used
                w.set(ACKED, acked)
        if not spec.open_loop:
            recv = w.total(spec.sub_slots, RECV)
            outstanding = (
                w.total(spec.pub_slots, SENT) - recv // fanout - w.total(spec.pub_slots, WRITEOFF)
            )
            blocked = outstanding + n > spec.window or (
                spec.qos and sent - acked + n > spec.inflight
            )
            if blocked:
                if recv != last_recv:
                    last_recv, last_progress = recv, now
                elif not spec.qos and now - last_progress > spec.stall_s and outstanding > 0:
                    # QoS 0 only: a broker may drop those.  QoS 1 messages were acknowledged
                    # and must arrive, so a QoS 1 publisher just waits (up to its deadline).
                    writeoff += outstanding
                    stalls += 1
                    w.set(WRITEOFF, writeoff)
                    w.set(STALLS, stalls)
                    last_progress = now
                if spec.qos:
                    select.select([sock], [], [], 0.001)
                else:
                    time.sleep(0.0002)
                continue
        if spec.qos:
            if pid + n > 65536:
                pid = 1
            sock.sendall(b"".join(pkts[pid : pid + n]))
            pid += n
        else:
            sock.sendall(batches[bi])
            bi = (bi + 1) % len(batches)
        sent += n
        w.set(SENT, sent)
    # Wait (bounded) for the last PUBACKs so "acked" is final.
    end = time.monotonic() + 3.0
    while spec.qos and acked < sent and time.monotonic() < end:
        r, _, _ = select.select([sock], [], [], 0.05)
        if r:
            chunk = sock.recv_into(memoryview(rbuf)[have:], len(rbuf) - have)
            if chunk == 0:
                break
            have += chunk
            k, used = wire.count_acks(rbuf, 0, have)
            acked += k
            rbuf[: have - used] = rbuf[used:have]
            have -= used
            w.set(ACKED, acked)
    w.wait_phase(DONE)
    with contextlib.suppress(OSError):
        sock.sendall(wire.DISCONNECT_BYTES)
    sock.close()
    return {"sent": sent, "acked": acked, "writeoff": writeoff, "stalls": stalls}


def subscriber(w: Worker) -> dict[str, Any]:
    """Several subscriber connections in one process, read through epoll; counts deliveries."""
    spec = w.spec
    sel = selectors.DefaultSelector()
    conns: list[tuple[socket.socket, bytearray]] = []
    for k, filters in enumerate(spec.filters):
        sock, pre = open_conn(
            spec.host, spec.port, f"{spec.client_prefix}-s{spec.index}-{k}", spec.connect_timeout
        )
        subscribe(sock, pre, filters, spec.qos, spec.connect_timeout)
        buf = bytearray(1 << 20)
        buf[: len(pre)] = pre
        state = [sock, buf, len(pre)]
        conns.append((sock, buf))
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, state)
    w.set(READY, 1)
    recv = dups = 0
    qos = spec.qos
    out = bytearray()
    ctl = w.ctl
    while ctl[PHASE] < DONE and time.monotonic() < w.deadline:
        for key, _ in sel.select(0.05):
            state = key.data
            sock, buf, have = state
            try:
                got = sock.recv_into(memoryview(buf)[have:], len(buf) - have)
            except BlockingIOError:
                continue
            if got == 0:
                raise ProtocolFailure("broker closed a subscriber connection")
            have += got
            if qos:
                k, d, used = wire.ack_publishes(buf, 0, have, out)
                dups += d
                if out:
                    sock.setblocking(True)
                    sock.sendall(out)
                    sock.setblocking(False)
                    out.clear()
            else:
                k, used = wire.count_publishes(buf, 0, have)
            if used:
                buf[: have - used] = buf[used:have]
            state[2] = have - used
            recv += k
            ctl[w.base + RECV] = recv
        ctl[w.base + DUPS] = dups
    for sock, _ in conns:
        with contextlib.suppress(OSError):
            sock.setblocking(True)
            sock.sendall(wire.DISCONNECT_BYTES)
        sock.close()
    sel.close()
    return {"received": recv, "dups": dups}


def latency(w: Worker) -> dict[str, Any]:
    """A publisher and a subscriber in one process (one clock) at a fixed rate, QoS 0."""
    spec = w.spec
    topic = spec.topics[0]
    sub, pre = open_conn(spec.host, spec.port, f"{spec.client_prefix}-lsub", spec.connect_timeout)
    subscribe(sub, pre, [topic], spec.qos, spec.connect_timeout)
    pub, _ = open_conn(spec.host, spec.port, f"{spec.client_prefix}-lpub", spec.connect_timeout)
    w.set(READY, 1)
    if not w.wait_phase(GO):
        raise ProtocolFailure("never told to start")
    buf = bytearray(1 << 16)
    buf[: len(pre)] = pre
    have = len(pre)
    stamps: list[int] = []
    lat: list[int] = []
    filler = b"x" * max(0, spec.payload_size - 8)
    head = wire.publish(topic, b"\0" * spec.payload_size)[: -spec.payload_size]
    interval = 1.0 / spec.rate
    sent = 0
    next_send = time.monotonic()
    sub.setblocking(False)
    ctl = w.ctl
    while ctl[PHASE] == GO and sent < spec.max_msgs and time.monotonic() < w.deadline:
        now = time.monotonic()
        if now >= next_send:
            stamp = time.monotonic_ns()
            pub.sendall(head + stamp.to_bytes(8, "big") + filler)
            sent += 1
            ctl[w.base + SENT] = sent
            next_send += interval
            if next_send < now:  # fell behind (e.g. descheduled): keep the rate, do not burst
                next_send = now + interval
        r, _, _ = select.select([sub], [], [], max(0.0, next_send - time.monotonic()))
        if r:
            got = sub.recv_into(memoryview(buf)[have:], len(buf) - have)
            arrived = time.monotonic_ns()
            if got == 0:
                raise ProtocolFailure("broker closed the latency subscriber")
            have += got
            used = wire.publish_stamps(buf, 0, have, stamps)
            lat.extend(arrived - s for s in stamps)
            stamps.clear()
            buf[: have - used] = buf[used:have]
            have -= used
            ctl[w.base + RECV] = len(lat)
    # Drain stragglers (bounded).
    end = time.monotonic() + 1.0
    while len(lat) < sent and time.monotonic() < end:
        r, _, _ = select.select([sub], [], [], 0.05)
        if r:
            got = sub.recv_into(memoryview(buf)[have:], len(buf) - have)
            arrived = time.monotonic_ns()
            if got == 0:
                break
            have += got
            used = wire.publish_stamps(buf, 0, have, stamps)
            lat.extend(arrived - s for s in stamps)
            stamps.clear()
            buf[: have - used] = buf[used:have]
            have -= used
    ctl[w.base + RECV] = len(lat)
    w.wait_phase(DONE)
    for s in (pub, sub):
        s.close()
    return {"sent": sent, "received": len(lat), "latencies_ns": lat}


def idle_connections(w: Worker) -> dict[str, Any]:
    """Open ``spec.connections`` MQTT connections, pipelined (<= 64 handshakes in flight,
    below the smallest listen backlog, so no SYN is dropped and retried after 1 s)."""
    spec = w.spec
    sel = selectors.DefaultSelector()
    pending: dict[int, tuple[socket.socket, bytes]] = {}
    established: list[socket.socket] = []
    failures = 0
    started = 0
    t0 = time.monotonic()
    limit = t0 + spec.connect_timeout
    while len(established) + failures < spec.connections and time.monotonic() < limit:
        while started < spec.connections and len(pending) < 64:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            s.connect_ex((spec.host, spec.port))
            pkt = wire.connect(f"{spec.client_prefix}-i{spec.index}-{started}")
            pending[s.fileno()] = (s, pkt)
            sel.register(s, selectors.EVENT_WRITE, "w")
            started += 1
        for key, _ in sel.select(0.1):
            s, pkt = pending[key.fd]
            try:
                if key.data == "w":
                    err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        raise OSError(err, "connect failed")
                    s.send(pkt)
                    sel.modify(s, selectors.EVENT_READ, "r")
                else:
                    data = s.recv(4)
                    if len(data) < 4 or data[0] != wire.CONNACK or data[3] != 0:
                        raise OSError("no CONNACK")
                    sel.unregister(s)
                    del pending[key.fd]
                    established.append(s)
            except OSError:
                sel.unregister(s)
                del pending[key.fd]
                s.close()
                failures += 1
        w.set(RECV, len(established))
    elapsed = time.monotonic() - t0
    for s, _ in pending.values():
        s.close()
    sel.close()
    w.set(READY, 1)
    w.wait_phase(DONE)
    for s in established:
        s.close()
    return {
        "connected": len(established),
        "failures": failures,
        "seconds": elapsed,
        "timed_out": len(established) + failures < spec.connections,
    }


def _publish_acked(w: Worker, sock: socket.socket, pkts: list[bytes], inflight: int) -> int:
    """Send QoS 1 packets keeping <= ``inflight`` unacknowledged; return PUBACKs seen."""
    buf = bytearray(1 << 16)
    have = sent = acked = 0
    while acked < len(pkts) and time.monotonic() < w.deadline:
        if sent < len(pkts) and sent - acked < inflight:
            k = min(inflight - (sent - acked), len(pkts) - sent, 64)
            sock.sendall(b"".join(pkts[sent : sent + k]))
            sent += k
        r, _, _ = select.select(
            [sock], [], [], 0 if sent - acked < inflight and sent < len(pkts) else 0.05
        )
        if r:
            got = sock.recv_into(memoryview(buf)[have:], len(buf) - have)
            if got == 0:
                raise ProtocolFailure("broker closed the retained publisher")
            have += got
            n, used = wire.count_acks(buf, 0, have)
            acked += n
            buf[: have - used] = buf[used:have]
            have -= used
            w.set(ACKED, acked)  # progress, so a timed-out scenario can say how far it got
    return acked


def retained(w: Worker) -> dict[str, Any]:
    """Store ``max_msgs`` retained topics (QoS 1), then time one ``prefix/#`` subscriber
    receiving all of them, then clear them again (so a long-lived ``--target`` stays clean)."""
    spec = w.spec
    prefix = spec.topics[0]
    n = spec.max_msgs
    body = wire.payload(spec.payload_size)
    pub, _ = open_conn(spec.host, spec.port, f"{spec.client_prefix}-rpub", spec.connect_timeout)
    w.set(READY, 1)
    if not w.wait_phase(GO):
        raise ProtocolFailure("never told to start")
    pkts = [wire.publish(f"{prefix}/{i}", body, 1, i % 65535 + 1, retain=True) for i in range(n)]
    t0 = time.monotonic()
    acked = _publish_acked(w, pub, pkts, spec.inflight)
    publish_s = time.monotonic() - t0
    w.set(SENT, acked)

    sub = socket.create_connection((spec.host, spec.port), timeout=spec.connect_timeout)
    sub.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sub.sendall(wire.connect(f"{spec.client_prefix}-rsub"))
    buf = bytearray()
    first, body, end = read_frame(sub, buf, spec.connect_timeout)
    if first != wire.CONNACK or buf[body + 1] != 0:
        raise ProtocolFailure(f"retained subscriber: expected CONNACK 0, got {bytes(buf[:end])!r}")
    del buf[:end]
    have = len(buf)
    buf.extend(bytes((1 << 20) - have))
    t1 = time.monotonic()
    sub.sendall(wire.subscribe(1, [f"{prefix}/#"], 0))
    got_retained = wrong_qos = live = 0
    sub.settimeout(0.2)
    while got_retained < acked and time.monotonic() < w.deadline:
        try:
            got = sub.recv_into(memoryview(buf)[have:], len(buf) - have)
        except TimeoutError:
            continue
        if got == 0:
            raise ProtocolFailure("broker closed the retained subscriber")
        have += got
        i = 0
        while (frame := wire.next_frame(buf, i, have)) is not None:
            first, body, i = frame
            if first & 0xF0 == wire.PUBLISH:
                # Counted with or without RETAIN: a broker that acknowledges before it stores
                # (amqtt) delivers late-stored messages live, with RETAIN=0.
                got_retained += 1
                live += not first & 0x01
                if first & 0x06:
                    # Granted QoS 0, so this is the broker's error ([MQTT-3.8.4-6]); ack it
                    # anyway so a broker waiting for PUBACK is measured, not deadlocked.
                    wrong_qos += 1
                    p = body + 2 + ((buf[body] << 8) | buf[body + 1])
                    sub.sendall(b"\x40\x02" + bytes(buf[p : p + 2]))
        buf[: have - i] = buf[i:have]
        have -= i
        w.set(RECV, got_retained)
    receive_s = time.monotonic() - t1
    sub.close()

    clear = [wire.publish(f"{prefix}/{i}", b"", 1, i % 65535 + 1, retain=True) for i in range(n)]
    t2 = time.monotonic()
    _publish_acked(w, pub, clear, spec.inflight)
    clear_s = time.monotonic() - t2
    pub.close()
    return {
        "sent": n,
        "acked": acked,
        "received": got_retained,
        "publish_s": publish_s,
        "receive_s": receive_s,
        "clear_s": clear_s,
        "wrong_qos": wrong_qos,
        "live_not_retained": live,
        "timed_out": got_retained < acked,
    }
