"""Feeding link frames to ``Links.serve_stream`` over an in-memory stream, for the tests of
the receiving end (``test_cluster_messages.py``, ``test_link_replay.py``)."""

from __future__ import annotations

import trio
import trio.testing

from mqttring.cluster.links import Links
from mqttring.rpc import FramedStream, Peer, ProtocolError


async def serve_frames(links: Links, payloads: list[bytes], session: int = 1,
                       node: str = "peer") -> tuple[Exception | None, list[int]]:
    """Feed ``payloads`` as one connection of link session ``session`` from ``node``; what
    ``serve_stream`` raised (None at the end of the stream) and the acknowledgements it
    wrote, in order.  Tests that call it take ``autojump_clock``: the receiver's
    acknowledgement delay then passes as soon as everything waits, so every acknowledgement
    due is written before the stream ends."""
    ours, theirs = trio.testing.memory_stream_pair()
    sender = FramedStream(theirs)
    outcome: list[Exception | None] = []

    async def serve() -> None:
        try:
            await links.serve_stream(FramedStream(ours), Peer(node, "127.0.0.1:1"),
                                     {"session": session})
        except (ProtocolError, EOFError) as exc:
            outcome.append(None if isinstance(exc, EOFError) else exc)
        else:
            outcome.append(None)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        for payload in payloads:
            await sender.send_packed(payload)
        await trio.sleep(1)  # virtual time: many acknowledgement delays
        await theirs.send_eof()
    await ours.send_eof()
    raw = b""
    while chunk := await theirs.receive_some():
        raw += chunk
    return outcome[0], [int.from_bytes(raw[i:i + 8], "big") for i in range(0, len(raw), 8)]
