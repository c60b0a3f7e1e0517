"""Packed QoS 0 batches: the form plain QoS 0 traffic takes on a cluster link.

Why not one ``Pub``/``Dlv`` message per publish like other link traffic: QoS 0 publishes
are most of the traffic and need nothing but topic and payload, and the PUBLISH a subscriber
is sent is the same bytes on every node.  So the edge sends the owner, and the owner sends
each subscribing node, the encoded MQTT PUBLISH itself (QoS 0, RETAIN 0), appended to the
packed batch at the tail of the link's queue: one link message carries a whole burst
(``messages.Batch``, on the wire ``["q0", blob, count, index]``)::

    blob:  the PUBLISH frames back to back
    index: [section, topic, frames, bytes, section, topic, frames, bytes, ...]

The index describes *runs*: consecutive frames of one topic and one section.  The sender
builds it as it appends (it knows each frame's topic), so the receiver never parses a frame
on the hot path: a run is routed once and appended to each subscriber's output in one piece,
byte for byte as it arrived, and msgpack decodes the index at C speed.

Sections say what a run is for:

* ``ROUTE`` (0): edge -> owner of the topic's shard, first hop (a ``Pub`` with hops=1);
* ``DELIVER`` (1): owner -> a node with routes to clean sessions only (a ``Dlv`` without
  shards).

Both share one batch so that traffic of both kinds to one peer stays in one piece and in
order.  Any other QoS, RETAIN (on both hops: a v5 subscriber with Retain As Published sees
it), MQTT 5 properties, or a delivery that must check session shards travels as its own
message (``Pub``, ``Dlv``).

The frame codec checks the batch's types (``messages.Batch``); what types cannot say,
``runs`` checks: the index's shape and that it covers the blob exactly with PUBLISH frames,
so a bug or version skew closes the link (``ValueError`` -> ``PeerProtocolError`` in
``Links.serve_stream``) instead of delivering garbled bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mqttring.cluster.messages import Batch
from mqttring.protocol.decoder import PacketDecoder
from mqttring.protocol.errors import MQTTError
from mqttring.protocol.message import Message
from mqttring.protocol.packets import Publish

#: Sections.
ROUTE = 0
DELIVER = 1
#: A batch that grows past this many bytes is closed and a new one started, so one link
#: message (and the frame carrying it) stays well under ``rpc.MAX_FRAME``.
MAX_BATCH_BYTES = 256 * 1024

#: One run of a batch: (section, topic, start, stop, count) where ``blob[start:stop]``
#: holds ``count`` consecutive PUBLISH frames of that topic in that section.
Run = tuple[int, str, int, int, int]


def new_batch(section: int, topic: str, frames: bytes | memoryview, count: int) -> Batch:
    """The link message for a first run; ``append`` adds to it while it is queued."""
    return Batch(bytearray(frames), count, [section, topic, count, len(frames)])


def append(batch: Batch, section: int, topic: str, frames: bytes | memoryview,
           count: int) -> None:
    # A bytearray while queued (``new_batch``): extended in place, no attribute rebinding.
    batch.blob.extend(frames)  # type: ignore[attr-defined]
    batch.count += count
    index = batch.index
    if index[-3] == topic and index[-4] == section:
        index[-2] += count  # type: ignore[operator]
        index[-1] += len(frames)  # type: ignore[operator]
    else:
        index += (section, topic, count, len(frames))


def runs(blob: Any, index: Any) -> Iterator[Run]:
    """The runs of a received batch, checked against the blob as described above."""
    if not isinstance(blob, bytes) or not isinstance(index, list) or len(index) % 4:
        raise ValueError("QoS 0 batch without a blob and a run index")
    pos, end = 0, len(blob)
    entries = iter(index)
    for section, topic, count, size in zip(entries, entries, entries, entries, strict=True):
        stop = pos + size
        if (section != ROUTE and section != DELIVER) or type(topic) is not str \
                or type(count) is not int or count < 1 or type(size) is not int \
                or size < 4 or stop > end or blob[pos] != 0x30:
            raise ValueError(f"QoS 0 batch has a bad run at byte {pos}")
        yield section, topic, pos, stop, count
        pos = stop
    if pos != end:
        raise ValueError("QoS 0 batch index does not cover its blob")


def unpack(frames: bytes | bytearray | memoryview) -> Iterator[Message]:
    """One ``Message`` per frame of a run, for the paths that need them one by one (an
    archive, an offline persistent session, a view change in flight): rare enough to go
    through the full MQTT decoder (its errors become ``ValueError`` like every other)."""
    decoder = PacketDecoder()
    decoder.feed(frames)
    while True:
        try:
            packet = decoder.next_packet()
        except MQTTError as exc:
            raise ValueError(f"QoS 0 batch holds a malformed frame: {exc}") from None
        if packet is None:
            break
        if not isinstance(packet, Publish) or packet.qos or packet.retain:
            raise ValueError(f"QoS 0 batch holds {packet!r}, not a plain QoS 0 PUBLISH")
        yield Message(packet.topic, packet.payload)
    if decoder.buffered:
        raise ValueError("QoS 0 batch run ends in a truncated frame")


__all__ = ["DELIVER", "MAX_BATCH_BYTES", "ROUTE", "Run", "append", "new_batch",
           "runs", "unpack"]
