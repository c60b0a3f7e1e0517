"""``serve_http``: the HTTP listener as one more task in the node's nursery.

Hypercorn's trio worker serves the ASGI app on the node's own trio loop, so the API reads
the broker's state directly (no locks, no threads) and a request never blocks the loop
longer than the node's own code does.  Cancelling the nursery stops it (Hypercorn gives
open requests ``GRACEFUL_TIMEOUT`` seconds).

Two changes to Hypercorn's HTTP/1.1 protocol (``_H11Protocol``, checked against 0.18):

* Bytes after a request that asked to close the connection (``Connection: close``, or
  HTTP/1.0) are dropped, unread (RFC 9112 9.6: such bytes are not processed).  Hypercorn
  fed them to h11, which refuses data there, and answered 400 while the app was still
  answering the request: the two met on the socket (``trio.BusyResourceError`` in the app's
  write, an "Error in ASGI Framework" traceback in the log, and no answer), or the bare 400
  went first and the app's JSON answer was lost (a fuzz probe of 2026-11-29: a publish body
  longer than its ``Content-Length``).
* Hypercorn's own refusals of a malformed request (400, 431...) carry a JSON body
  ``{"error": ...}`` as the app's do, where they had none.
"""

from __future__ import annotations

import json
import logging
from functools import partial
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import h11
import hypercorn.protocol
import trio
from hypercorn.config import Config
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio import serve

from mqttring.config import format_hostport, parse_hostport
from mqttring.errors import ListenError, sole_exception
from mqttring.http.app import build_app

if TYPE_CHECKING:
    from mqttring.embedded import MqttRingBroker

log = logging.getLogger("mqttring.http")


class _NoBanner(logging.Filter):
    """Drops hypercorn's "Running on http://... (CTRL + C to quit)": the node logs its own
    line (the URL, and whether a token is needed), and nobody quits a node with CTRL + C
    from a service manager's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith("Running on "))


_server_log = logging.getLogger("mqttring.http.server")
_server_log.addFilter(_NoBanner())

GRACEFUL_TIMEOUT = 1.0


class _H11Connection(h11.Connection):
    """h11's server side, deaf once a request that closes the connection has ended (the
    module docstring says why): the bytes after it are not parsed, so not refused."""

    _deaf = False

    def receive_data(self, data: bytes) -> None:
        if data and (self._deaf or self.their_state is h11.MUST_CLOSE):
            log.debug("HTTP: %d bytes after a request that closes the connection, dropped",
                      len(data))
            return
        super().receive_data(data)

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        if not self._deaf and self.their_state is h11.MUST_CLOSE and self.trailing_data[0]:
            # Came in the same read as the request's end: left in h11's buffer, unread.
            log.debug("HTTP: bytes after a request that closes the connection, dropped")
            self._deaf = True
        if self._deaf:
            return h11.NEED_DATA
        return super().next_event()


class _H11Protocol(H11Protocol):
    """Hypercorn's HTTP/1.1 connection, with the two changes the module docstring gives."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connection = _H11Connection(
            h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size)

    async def _send_error_response(self, status_code: int) -> None:
        try:
            reason = HTTPStatus(status_code).phrase.lower()
        except ValueError:
            reason = "refused"
        body = json.dumps({"error": f"malformed HTTP request ({reason})"}).encode()
        await self._send_h11_event(h11.Response(
            status_code=status_code,
            headers=[(b"content-type", b"application/json"),
                     (b"content-length", b"%d" % len(body)), (b"connection", b"close"),
                     *self.config.response_headers("h11")]))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())


# ``ProtocolWrapper`` builds each HTTP/1.1 connection from this module-level name.
hypercorn.protocol.H11Protocol = _H11Protocol  # type: ignore[misc]


async def serve_http(broker: MqttRingBroker, *,
                     task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``broker.config.http`` until cancelled; ``started`` with the bound port."""
    config = broker.config
    assert config.http is not None
    host, port = parse_hostport(config.http)
    hyper = Config()
    hyper.bind = [format_hostport(host, port)]
    hyper.accesslog = None
    hyper.errorlog = _server_log
    hyper.graceful_timeout = GRACEFUL_TIMEOUT
    # Hypercorn waits for a request's bytes for ever by default (a slow-body client held a
    # connection and its task indefinitely).
    hyper.read_timeout = config.http_read_timeout  # type: ignore[assignment]
    hyper.include_server_header = False
    async with trio.open_nursery() as nursery:
        try:
            binds: list[str] = await nursery.start(partial(serve, build_app(broker), hyper))
        except (OSError, BaseExceptionGroup) as exc:
            # A busy port, named as the MQTT listeners name theirs (hypercorn raises it
            # from a nursery of its own, in a group).
            cause = sole_exception(exc)
            if not isinstance(cause, OSError):
                raise
            raise ListenError(config.http, cause) from None
        bound = int(binds[0].rpartition(":")[2])
        # A URL to paste: an IPv6 host in brackets (http://[::1]:8080/, not http://::1:8080/).
        log.info("node %s: HTTP API, /metrics and dashboard on http://%s/ (%s)",
                 config.node_id, format_hostport(host, bound),
                 "token required" if config.http_token else "no token: loopback only")
        task_status.started(bound)
