"""Hand-encoded MQTT 3.1.1 packets and a fast frame walker for the load generator.

Why not use ``mqttring.protocol.codec``: the generator must be measurably faster than any
broker it measures, and must keep working while the broker's own codec is being rewritten.
So packets are built once, as bytes, before a scenario starts (a batch of PUBLISH frames is
one ``bytes`` object sent with one ``sendall``), and the reading side never decodes a packet
into an object: it walks length-prefixed frames in a ``bytearray`` and looks only at the
bytes a scenario needs (the type nibble, a packet id, an 8-byte timestamp).

Everything here is pure and does no I/O, so the same functions are unit-tested on byte
literals (``tests/test_benchmarks.py``).
"""

from __future__ import annotations

import struct

CONNACK = 0x20
PUBLISH = 0x30
PUBACK = 0x40
SUBACK = 0x90
DISCONNECT_BYTES = b"\xe0\x00"
PINGREQ_BYTES = b"\xc0\x00"


def encode_remaining_length(n: int) -> bytes:
    """Variable-length integer of the fixed header ([MQTT-2.2.3])."""
    out = bytearray()
    while True:
        digit = n % 128
        n //= 128
        if n:
            digit |= 0x80
        out.append(digit)
        if not n:
            return bytes(out)


def _string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack(">H", len(raw)) + raw


def connect(client_id: str, keepalive: int = 0, clean_session: bool = True) -> bytes:
    """CONNECT with no will, no credentials.

    ``keepalive=0`` by default so idle connections are not closed by the broker while a
    scenario holds them open (the generator never sends PINGREQ in a hot loop).
    """
    flags = 0x02 if clean_session else 0x00
    body = _string("MQTT") + bytes([4, flags]) + struct.pack(">H", keepalive) + _string(client_id)
    return bytes([0x10]) + encode_remaining_length(len(body)) + body


def publish(
    topic: str, payload: bytes, qos: int = 0, packet_id: int = 0, retain: bool = False
) -> bytes:
    header = PUBLISH | (qos << 1) | (1 if retain else 0)
    body = _string(topic)
    if qos:
        body += struct.pack(">H", packet_id)
    body += payload
    return bytes([header]) + encode_remaining_length(len(body)) + body


def subscribe(packet_id: int, filters: list[str], qos: int) -> bytes:
    body = struct.pack(">H", packet_id) + b"".join(_string(f) + bytes([qos]) for f in filters)
    return b"\x82" + encode_remaining_length(len(body)) + body


def puback(packet_id: int) -> bytes:
    return b"\x40\x02" + struct.pack(">H", packet_id)


def payload(size: int, stamp_ns: int = 0) -> bytes:
    """A payload of ``size`` bytes whose first 8 bytes carry a monotonic timestamp (ns)."""
    return struct.pack(">q", stamp_ns) + b"x" * max(0, size - 8)


def next_frame(buf: bytearray | bytes, i: int, end: int) -> tuple[int, int, int] | None:
    """``(first_byte, body_start, frame_end)`` of the frame at ``i``, or None if incomplete."""
    if i + 2 > end:
        return None
    mult = 1
    rl = 0
    j = i + 1
    while True:
        if j >= end:
            return None
        b = buf[j]
        rl += (b & 0x7F) * mult
        j += 1
        if b < 0x80:
            break
        mult *= 128
        if j - i > 5:
            raise ValueError("remaining length longer than 4 bytes")
    if j + rl > end:
        return None
    return buf[i], j, j + rl


def count_publishes(buf: bytearray, i: int, end: int) -> tuple[int, int]:
    """Count complete PUBLISH frames in ``buf[i:end]``; return ``(count, offset_after)``.

    The hot path of every QoS 0 subscriber: one- and two-byte remaining lengths (all
    benchmark frames) are decoded inline, anything longer falls back to ``next_frame``.
    """
    n = 0
    while i + 2 <= end:
        b1 = buf[i + 1]
        if b1 < 0x80:
            nxt = i + 2 + b1
        elif i + 3 <= end and buf[i + 2] < 0x80:
            nxt = i + 3 + (b1 & 0x7F) + (buf[i + 2] << 7)
        else:
            frame = next_frame(buf, i, end)
            if frame is None:
                break
            nxt = frame[2]
        if nxt > end:
            break
        if buf[i] & 0xF0 == PUBLISH:
            n += 1
        i = nxt
    return n, i


def ack_publishes(buf: bytearray, i: int, end: int, out: bytearray) -> tuple[int, int, int]:
    """Walk frames, append a PUBACK to ``out`` for every QoS 1 PUBLISH.

    Returns ``(publishes, duplicates, offset_after)``; duplicates are frames with the DUP flag,
    counted apart so that a redelivery is never mistaken for a new message.
    """
    n = dups = 0
    while True:
        frame = next_frame(buf, i, end)
        if frame is None:
            break
        first, body, nxt = frame
        if first & 0xF0 == PUBLISH:
            n += 1
            if first & 0x08:
                dups += 1
            if first & 0x06:
                tl = (buf[body] << 8) | buf[body + 1]
                p = body + 2 + tl
                out += b"\x40\x02"
                out += buf[p : p + 2]
        i = nxt
    return n, dups, i


def publish_stamps(buf: bytearray, i: int, end: int, stamps: list[int]) -> int:
    """Append the timestamp carried by each PUBLISH payload to ``stamps``; return offset."""
    while True:
        frame = next_frame(buf, i, end)
        if frame is None:
            return i
        first, body, nxt = frame
        if first & 0xF0 == PUBLISH:
            p = body + 2 + ((buf[body] << 8) | buf[body + 1])
            if first & 0x06:
                p += 2
            stamps.append(struct.unpack_from(">q", buf, p)[0])
        i = nxt


def count_acks(buf: bytearray, i: int, end: int) -> tuple[int, int]:
    """Count PUBACK frames (fixed 4 bytes each); return ``(count, offset_after)``."""
    n = 0
    while i + 4 <= end:
        if buf[i] == PUBACK:
            n += 1
            i += 4
        else:
            frame = next_frame(buf, i, end)
            if frame is None:
                break
            i = frame[2]
    return n, i
