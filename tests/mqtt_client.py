"""A tiny raw-socket MQTT 3.1.1 client for the end-to-end tests.

Why not the project's codec: these tests are the independent check that the broker speaks
MQTT 3.1.1, so the bytes on the wire are built and parsed here, straight from the
specification (section 2 fixed header, section 3 packet layouts).  A symmetric bug in the
project's codec (wrong flag bit, wrong length encoding) would otherwise cancel out.  This
client also has to send what no correct codec produces: wrong fixed-header flags, QoS 3,
invalid UTF-8, DUP on QoS 0, packet id 0, truncated or oversized packets.

Everything is blocking with explicit timeouts, so a test that waits for a packet can never
hang: ``recv_packet(timeout=...)`` raises ``TimeoutError`` and ``wait_closed`` returns False.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import subprocess
import time
from dataclasses import dataclass

# Control packet types (MQTT 3.1.1 section 2.2.1).
CONNECT = 1
CONNACK = 2
PUBLISH = 3
PUBACK = 4
PUBREC = 5
PUBREL = 6
PUBCOMP = 7
SUBSCRIBE = 8
SUBACK = 9
UNSUBSCRIBE = 10
UNSUBACK = 11
PINGREQ = 12
PINGRESP = 13
DISCONNECT = 14

TYPE_NAMES = {
    1: "CONNECT", 2: "CONNACK", 3: "PUBLISH", 4: "PUBACK", 5: "PUBREC", 6: "PUBREL",
    7: "PUBCOMP", 8: "SUBSCRIBE", 9: "SUBACK", 10: "UNSUBSCRIBE", 11: "UNSUBACK",
    12: "PINGREQ", 13: "PINGRESP", 14: "DISCONNECT",
}


class ConnectionClosed(Exception):
    """The peer closed the TCP connection while a packet was expected."""


# --------------------------------------------------------------------------- encoding


def encode_remaining_length(n: int) -> bytes:
    """Section 2.2.3: 7 bits per byte, continuation bit 0x80, at most 4 bytes."""
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        if n:
            byte |= 0x80
        out.append(byte)
        if not n:
            return bytes(out)


def mqtt_string(s: str | bytes) -> bytes:
    """Section 1.5.3: two-byte big-endian length then the bytes (raw bytes pass unchecked)."""
    data = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("!H", len(data)) + data


def packet(first_byte: int, body: bytes) -> bytes:
    return bytes([first_byte]) + encode_remaining_length(len(body)) + body


def connect(
    client_id: str | bytes = "",
    *,
    clean_session: bool = True,
    keepalive: int = 60,
    will: tuple[str, bytes, int, bool] | None = None,
    username: str | None = None,
    password: bytes | None = None,
    protocol_name: str = "MQTT",
    protocol_level: int = 4,
    reserved_flag: bool = False,
    flags_override: int | None = None,
) -> bytes:
    """Section 3.1; ``will`` is (topic, payload, qos, retain)."""
    flags = 0
    if reserved_flag:
        flags |= 0x01
    if clean_session:
        flags |= 0x02
    payload = mqtt_string(client_id)
    if will is not None:
        topic, message, qos, retain = will
        flags |= 0x04 | (qos << 3) | (0x20 if retain else 0)
        payload += mqtt_string(topic) + mqtt_string(message)
    if username is not None:
        flags |= 0x80
        payload += mqtt_string(username)
    if password is not None:
        flags |= 0x40
        payload += mqtt_string(password)
    if flags_override is not None:
        flags = flags_override
    header = mqtt_string(protocol_name) + bytes([protocol_level, flags]) + struct.pack(
        "!H", keepalive
    )
    return packet(0x10, header + payload)


def publish(
    topic: str | bytes,
    payload: bytes = b"",
    *,
    qos: int = 0,
    retain: bool = False,
    dup: bool = False,
    packet_id: int | None = None,
) -> bytes:
    """Section 3.3; no validation at all, so invalid combinations can be sent on purpose."""
    first = 0x30 | (0x08 if dup else 0) | ((qos & 0x03) << 1) | (0x01 if retain else 0)
    body = mqtt_string(topic)
    if packet_id is not None:
        body += struct.pack("!H", packet_id)
    return packet(first, body + payload)


def subscribe(packet_id: int, filters: list[tuple[str | bytes, int]], first: int = 0x82) -> bytes:
    """Section 3.8; fixed-header flags MUST be 0010 [MQTT-3.8.1-1] unless overridden."""
    body = struct.pack("!H", packet_id)
    for topic_filter, qos in filters:
        body += mqtt_string(topic_filter) + bytes([qos])
    return packet(first, body)


def unsubscribe(packet_id: int, filters: list[str]) -> bytes:
    body = struct.pack("!H", packet_id)
    for topic_filter in filters:
        body += mqtt_string(topic_filter)
    return packet(0xA2, body)


def puback(packet_id: int) -> bytes:
    return packet(0x40, struct.pack("!H", packet_id))


def pubrec(packet_id: int) -> bytes:
    return packet(0x50, struct.pack("!H", packet_id))


def pubrel(packet_id: int) -> bytes:
    """PUBREL fixed-header flags are 0010 [MQTT-3.6.1-1]."""
    return packet(0x62, struct.pack("!H", packet_id))


def pubcomp(packet_id: int) -> bytes:
    return packet(0x70, struct.pack("!H", packet_id))


PINGREQ_BYTES = b"\xc0\x00"
DISCONNECT_BYTES = b"\xe0\x00"


# --------------------------------------------------------------------------- decoding


@dataclass
class Packet:
    """One decoded packet; only the fields meaningful for its type are filled in."""

    type: int
    flags: int
    body: bytes
    packet_id: int | None = None
    # CONNACK
    session_present: bool | None = None
    return_code: int | None = None
    # PUBLISH
    topic: str | None = None
    payload: bytes | None = None
    qos: int | None = None
    retain: bool | None = None
    dup: bool | None = None
    # SUBACK
    return_codes: list[int] | None = None

    @property
    def name(self) -> str:
        return TYPE_NAMES.get(self.type, f"type{self.type}")

    def __repr__(self) -> str:
        if self.type == PUBLISH:
            return (
                f"PUBLISH(topic={self.topic!r}, payload={self.payload!r}, qos={self.qos}, "
                f"retain={self.retain}, dup={self.dup}, packet_id={self.packet_id})"
            )
        if self.type == CONNACK:
            return f"CONNACK(sp={self.session_present}, rc={self.return_code})"
        if self.type == SUBACK:
            return f"SUBACK(packet_id={self.packet_id}, codes={self.return_codes})"
        return f"{self.name}(flags={self.flags:#x}, packet_id={self.packet_id}, body={self.body!r})"


def parse(first_byte: int, body: bytes) -> Packet:
    ptype, flags = first_byte >> 4, first_byte & 0x0F
    pkt = Packet(ptype, flags, body)
    if ptype == CONNACK and len(body) == 2:
        pkt.session_present = bool(body[0] & 0x01)
        pkt.return_code = body[1]
    elif ptype == PUBLISH:
        pkt.qos = (flags >> 1) & 0x03
        pkt.retain = bool(flags & 0x01)
        pkt.dup = bool(flags & 0x08)
        (tlen,) = struct.unpack_from("!H", body, 0)
        pkt.topic = body[2 : 2 + tlen].decode("utf-8")
        pos = 2 + tlen
        if pkt.qos:
            (pkt.packet_id,) = struct.unpack_from("!H", body, pos)
            pos += 2
        pkt.payload = body[pos:]
    elif ptype in (PUBACK, PUBREC, PUBREL, PUBCOMP, UNSUBACK) and len(body) >= 2:
        (pkt.packet_id,) = struct.unpack_from("!H", body, 0)
    elif ptype == SUBACK:
        (pkt.packet_id,) = struct.unpack_from("!H", body, 0)
        pkt.return_codes = list(body[2:])
    return pkt


class StreamDecoder:
    """Incremental decoder: feed any chunks, take out whole packets."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self.buffer += data

    def next_packet(self) -> Packet | None:
        buf = self.buffer
        if len(buf) < 2:
            return None
        length, multiplier, pos = 0, 1, 1
        while True:
            if pos >= len(buf):
                return None
            byte = buf[pos]
            length += (byte & 0x7F) * multiplier
            multiplier *= 128
            pos += 1
            if not byte & 0x80:
                break
            if pos > 4:
                raise ValueError("remaining length longer than 4 bytes from the broker")
        if len(buf) < pos + length:
            return None
        first, body = buf[0], bytes(buf[pos : pos + length])
        del buf[: pos + length]
        return parse(first, body)


# --------------------------------------------------------------------------- client


class RawClient:
    """One TCP connection to the broker; every wait is bounded."""

    def __init__(
        self, host: str, port: int, timeout: float = 5.0, rcvbuf: int | None = None,
        source: str | None = None,
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        if source is not None:
            self.sock.bind((source, 0))  # another loopback address: another client host
        if rcvbuf is not None:
            # Before connect, so the TCP window is small from the start (slow-reader tests).
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout)
        self.sock.connect((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.decoder = StreamDecoder()
        self.eof = False

    # -- sending
    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def try_send(self, data: bytes) -> bool:
        """Send, returning False instead of raising if the broker already closed us."""
        try:
            self.sock.sendall(data)
        except OSError:
            return False
        return True

    # -- receiving
    def _fill(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("no packet from the broker in time")
        self.sock.settimeout(remaining)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            raise TimeoutError("no packet from the broker in time") from None
        except (ConnectionResetError, BrokenPipeError):
            data = b""
        if not data:
            self.eof = True
            raise ConnectionClosed("broker closed the connection")
        self.decoder.feed(data)

    def recv_packet(self, timeout: float = 5.0) -> Packet:
        deadline = time.monotonic() + timeout
        while True:
            pkt = self.decoder.next_packet()
            if pkt is not None:
                return pkt
            if self.eof:
                raise ConnectionClosed("broker closed the connection")
            self._fill(deadline)

    def expect(self, ptype: int, timeout: float = 5.0) -> Packet:
        pkt = self.recv_packet(timeout)
        assert pkt.type == ptype, f"expected {TYPE_NAMES[ptype]}, got {pkt!r}"
        return pkt

    def no_packet_within(self, seconds: float) -> Packet | None:
        """Return a packet that arrived within ``seconds``, or None if none did."""
        try:
            return self.recv_packet(seconds)
        except TimeoutError:
            return None

    def wait_closed(self, timeout: float = 5.0) -> bool:
        """True once the broker has closed the connection (packets before EOF are discarded)."""
        deadline = time.monotonic() + timeout
        while not self.eof:
            try:
                self._fill(deadline)
            except TimeoutError:
                return False
            except ConnectionClosed:
                return True
            self.decoder.buffer.clear()
        return True

    def packets_until_closed(self, timeout: float = 5.0) -> tuple[list[Packet], bool]:
        """Every packet received until EOF, and whether EOF came within ``timeout``."""
        got: list[Packet] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                got.append(self.recv_packet(max(deadline - time.monotonic(), 0.001)))
            except ConnectionClosed:
                return got, True
            except TimeoutError:
                return got, False

    # -- conveniences
    def connect(self, client_id: str | bytes = "", timeout: float = 5.0, **kw: object) -> Packet:
        """Send CONNECT and return the CONNACK (whatever its return code)."""
        self.send(connect(client_id, **kw))  # type: ignore[arg-type]
        return self.expect(CONNACK, timeout)

    def subscribe(self, filters: list[tuple[str, int]], packet_id: int = 1) -> list[int]:
        self.send(subscribe(packet_id, filters))
        ack = self.expect(SUBACK)
        assert ack.packet_id == packet_id, "[MQTT-3.8.4-2] SUBACK must echo the packet id"
        assert ack.return_codes is not None
        return ack.return_codes

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


# --------------------------------------------------------------------------- processes


def read_until(proc: subprocess.Popen[bytes], needle: bytes, timeout: float = 5.0) -> bytes:
    """Read ``proc.stdout`` until ``needle`` appears (bounded); returns everything read."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"{needle!r} not printed within {timeout}s; got {seen!r}")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                raise AssertionError(f"process exited before printing {needle!r}; got {seen!r}")
            seen += chunk
    return seen
