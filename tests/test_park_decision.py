"""The park decision of ``ClientHandler`` against a read that slips in before it lands.

The timers decide to park a quiet connection (``on_timer``) and cancel its reader, but the
reader may already have been handed bytes in the same scheduler batch: it handles them and
arms its timeouts again (``_arm``) before the cancellation reaches it, and the connection
then parks.  A 5-node fault run hit this once: the park found the deadline it was to carry
already taken by that ``_arm`` (an assertion, the connection closed as an internal error).
A real core, a real socket and a real parking lot; the scheduling race itself is played out
by calling the steps in that order.
"""

from __future__ import annotations

import socket

import trio

from mqttring.broker.client import ClientHandler
from mqttring.broker.core import BrokerCore
from mqttring.broker.metrics import BrokerMetrics
from mqttring.broker.parking import ParkingLot
from mqttring.broker.retained import RetainedStore
from mqttring.broker.router import LocalRouter
from mqttring.broker.session_store import SessionStore
from mqttring.broker.timers import ConnectionTimers
from mqttring.broker.transport import TcpTransport
from mqttring.config import BrokerConfig
from mqttring.protocol.codec import encode
from mqttring.protocol.events import ConnectRequested
from mqttring.protocol.packets import Connect
from mqttring.protocol.session import Session

KEEPALIVE = 10


def connected_handler(parking: ParkingLot, sock: socket.socket) -> ClientHandler:
    store = SessionStore(None, 16)
    core = BrokerCore(BrokerConfig(), store, BrokerMetrics(),
                      lambda core: LocalRouter(core.sessions, RetainedStore(None, 16), store,
                                               core.metrics, lambda client_id: None))
    handler = ClientHandler(core, TcpTransport(sock), ConnectionTimers(), parking)
    events = handler.conn.receive_data(bytes(encode(Connect(
        client_id="quiet", clean_session=True, keepalive=KEEPALIVE))))
    assert [type(e) for e in events] == [ConnectRequested]
    session = Session("quiet", True)
    handler.conn.accept(session, False)
    handler.session = session
    handler.conn.data_to_send()  # the CONNACK, as the writer would have sent it
    return handler


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return server, client


async def test_a_read_between_the_park_decision_and_the_park_moves_the_keepalive() -> None:
    a, b = tcp_pair()
    with a, b:
        async with trio.open_nursery() as lot_nursery:
            lot = ParkingLot(lot_nursery, BrokerMetrics())
            handler = connected_handler(lot, a)
            async with trio.open_nursery() as reader_nursery:
                handler._nursery = reader_nursery
                handler._receiving = True  # the reader waits for bytes
                handler._arm()
                first_due = handler._due
                park_at = handler._timer_at
                assert park_at < first_due  # the park look comes before the keepalive
                # The timers' look: quiet and idle, so park (cancels the reader's scope).
                handler.on_timer(park_at, park_at)
                assert handler._park_requested and reader_nursery.cancel_scope.cancel_called
                # Bytes were handed to the reader in the same batch: it handles them (a
                # PINGREQ, say) and arms its timeouts again before the cancellation lands
                # (no checkpoint in between: the shield only lets time pass here).
                with trio.CancelScope(shield=True):
                    await trio.sleep(0.01)
                handler.conn.packets_received += 1  # that PINGREQ: a whole packet
                handler._arm()
                later_due = handler._due
                assert later_due > first_due
            assert handler._park()  # idle again: parks, no assertion, no internal error
            parked = lot._parked[a.fileno()]
            assert parked == (handler, later_due)  # the keepalive runs from the last read
            lot_nursery.cancel_scope.cancel()
