"""What the session relay does when the link to the other node is full (no processes).

A link's ``send`` returns False when it dropped the message (its queue is at
``link_queue_messages``); ``send_control`` never drops.  The relay's messages whose loss
would break a promise go by ``send_control``; a home whose relayed output was dropped closes
that connection once and sends it nothing more (the end-to-end case:
``test_cluster_relay_full_link.py``).
"""

from __future__ import annotations

from typing import Any

import trio

from mqttring.cluster.messages_sessions import SessionAck, SessionBytes, SessionKick
from mqttring.cluster.relay import SessionProxy, SessionRelay


class FullLinks:
    """A link to every peer whose queue is full: ``send`` drops, ``send_control`` queues."""

    max_frame = 1024

    def __init__(self) -> None:
        self.dropped: list[Any] = []
        self.control: list[Any] = []

    def send(self, node: str, message: Any) -> bool:
        self.dropped.append(message)
        return False

    def send_control(self, node: str, message: Any) -> bool:
        self.control.append(message)
        return True


def test_dropped_session_output_closes_the_connection_once_and_sends_no_more() -> None:
    links = FullLinks()
    proxy = SessionProxy(links, "edge", "c1", "tok")  # type: ignore[arg-type]
    proxy.output += b"\x32\x09\x00\x01tm\x00\x01hi" * 200  # more than one piece
    proxy.wake()
    assert [type(m) for m in links.dropped] == [SessionBytes]  # the first piece, then stop
    assert links.control == [SessionKick(0, "c1", "tok", 0x97)]
    assert not proxy.output
    proxy.output += b"\x32\x09\x00\x01tm\x00\x02hi"
    proxy.wake()  # later output for the same connection: neither sent nor a second close
    assert len(links.dropped) == 1 and len(links.control) == 1
    assert not proxy.output


def test_the_clients_acknowledgements_are_never_dropped() -> None:
    links = FullLinks()

    async def main() -> None:
        relay = SessionRelay(None, links)  # type: ignore[arg-type]  # (no core needed)
        stand_in = relay.stand_in("c1", "home", "tok")
        relay._forward_ack(stand_in, 1, 7)  # PUBACK
        relay._forward_ack(stand_in, -5, 8)  # a PUBREC with a failure code

    trio.run(main)
    assert links.dropped == []
    assert links.control == [SessionAck("c1", "tok", 1, 7), SessionAck("c1", "tok", 5, 8, True)]
