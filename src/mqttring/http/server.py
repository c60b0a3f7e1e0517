"""``serve_http``: the HTTP listener as one more task in the node's nursery.

Hypercorn's trio worker serves the ASGI app on the node's own trio loop, so the API reads
the broker's state directly (no locks, no threads) and a request never blocks the loop
longer than the node's own code does.  Cancelling the nursery stops it (Hypercorn gives
open requests ``GRACEFUL_TIMEOUT`` seconds).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from mqttring.config import parse_hostport
from mqttring.errors import ListenError, sole_exception
from mqttring.http.app import build_app

if TYPE_CHECKING:
    from mqttring.embedded import MqttRingBroker

log = logging.getLogger("mqttring.http")

GRACEFUL_TIMEOUT = 1.0


async def serve_http(broker: MqttRingBroker, *,
                     task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``broker.config.http`` until cancelled; ``started`` with the bound port."""
    config = broker.config
    assert config.http is not None
    host, port = parse_hostport(config.http)
    hyper = Config()
    hyper.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    hyper.accesslog = None
    hyper.errorlog = logging.getLogger("mqttring.http.server")
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
        log.info("node %s: HTTP API, /metrics and dashboard on http://%s:%d/ (%s)",
                 config.node_id, host, bound,
                 "token required" if config.http_token else "no token: loopback only")
        task_status.started(bound)
