"""The park decision of ``ClientHandler`` (``on_timer``) against bytes that come around it.

The timers decide to park a quiet connection and cancel its reader; its task then stops a
few scheduler passes later.  Bytes may reach the socket just before the decision (reported
to the reader, not yet read), or between the decision and the task's end.  The lot watches
the socket from the decision itself (``_enter_lot``), so both are placed in arrival order
with other connections' bytes (``broker/arrival.py``).  A real core, a real socket and a
real parking lot; the scheduling races are played out by calling the steps in that order.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

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
PINGREQ = b"\xc0\x00"


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


@contextlib.asynccontextmanager
async def lot_with_handler(run_lot: bool = False
                           ) -> AsyncIterator[tuple[ParkingLot, ClientHandler, socket.socket,
                                                    socket.socket]]:
    """A parking lot (its task running if ``run_lot``) and a connected handler on a real
    TCP pair: (lot, handler, the node's socket, the client's)."""
    a, b = tcp_pair()
    with a, b:
        async with trio.open_nursery() as lot_nursery:
            lot = ParkingLot(lot_nursery, BrokerMetrics())
            if run_lot:
                lot_nursery.start_soon(lot.run)
            yield lot, connected_handler(lot, a), a, b
            lot_nursery.cancel_scope.cancel()


def quiet_reader(handler: ClientHandler, nursery: trio.Nursery) -> float:
    """The state of a connection whose reader waits for bytes; the time of the park look."""
    handler._nursery = nursery
    handler._has_task = True
    handler._receiving = True
    handler._arm()
    park_at = handler._timer_at
    assert park_at < handler._due  # the park look comes before the keepalive
    return park_at


async def test_the_lot_watches_the_socket_from_the_park_decision() -> None:
    """Bytes that come after the decision, while the task is still stopping, are the lot's
    to report: it takes their turn in its own pass, and the stopping task serves on with
    them instead of parking (before, the task took a turn as its reader was cancelled,
    bytes or not, ahead of bytes other connections received before its own)."""
    async with lot_with_handler(True) as (lot, handler, a, b):
        async with trio.open_nursery() as reader_nursery:
            park_at = quiet_reader(handler, reader_nursery)
            handler.on_timer(park_at, park_at)
            assert handler._park_requested and reader_nursery.cancel_scope.cancel_called
            assert lot.holds(handler, a.fileno())  # watched from the decision on
            assert not lot.turns.holds(handler)  # no bytes: no turn
            b.send(PINGREQ)
            with trio.fail_after(5), trio.CancelScope(shield=True):
                while lot.holds(handler, a.fileno()):
                    await trio.sleep(0.001)
        assert lot.turns.holds(handler)  # taken in the lot's pass that saw the bytes
        assert not handler._stays_parked()  # serves on, its task not replaced
        assert len(lot) == 0


async def test_bytes_waiting_at_the_decision_keep_the_reader() -> None:
    """Bytes already in the socket were reported to the reader in their order: the
    connection does not park, and its reader reads them."""
    async with (lot_with_handler() as (lot, handler, a, b),
                trio.open_nursery() as reader_nursery):
        park_at = quiet_reader(handler, reader_nursery)
        b.send(PINGREQ)
        with trio.fail_after(5):
            await trio.lowlevel.wait_readable(a)
        again = handler.on_timer(park_at, park_at)
        assert not handler._park_requested
        assert not reader_nursery.cancel_scope.cancel_called
        assert not lot.holds(handler, a.fileno()) and len(lot) == 0
        assert park_at < again < handler._due  # a new quiet stretch


async def test_a_read_after_the_decision_keeps_the_connection_serving() -> None:
    """A packet read and the timeouts armed again after the decision (the lot's keepalive
    deadline is then stale): the connection does not park and keeps the keepalive of that
    read.  A 5-node fault run once parked such a connection with a deadline already taken
    (an assertion, the connection closed as an internal error)."""
    async with lot_with_handler() as (lot, handler, a, _):
        async with trio.open_nursery() as reader_nursery:
            park_at = quiet_reader(handler, reader_nursery)
            first_due = handler._due
            handler.on_timer(park_at, park_at)
            assert lot.holds(handler, a.fileno())
            with trio.CancelScope(shield=True):
                await trio.sleep(0.01)
            handler.conn.packets_received += 1  # a PINGREQ, a whole packet
            handler._arm()
            later_due = handler._due
            assert later_due > first_due
        assert not handler._stays_parked()
        assert not lot.holds(handler, a.fileno()) and len(lot) == 0
        assert handler._due == later_due  # the keepalive runs from the last read
