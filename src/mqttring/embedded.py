"""``MqttRingBroker``: the composition root of a node, single or clustered.

The broker layer (``mqttring.broker``) runs one node and knows clustering only through the
``ClusterMember`` seam; the cluster layer (``mqttring.cluster``) builds on the broker layer.
This module sits above both and decides which parts a node gets: with ``config.cluster``
set, the cluster data plane; otherwise a single node's local router and sessions.  With
``config.http`` set it also runs the HTTP API (``mqttring.http``) beside the node.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import trio

from mqttring.broker.files import NodeFiles
from mqttring.broker.server import BoundPorts, BrokerNode
from mqttring.cluster.plane import DataPlane
from mqttring.config import BrokerConfig, ConfigError


class MqttRingBroker(BrokerNode):
    """An MQTT node: one broker, or a cluster member when ``config.cluster`` is set.

    See ``docs/embedding.md`` for running it inside a trio program (``async with``,
    ``nursery.start(broker.serve)``) or a plain Python one (``start()``/``stop()``).
    """

    def __init__(self, config: BrokerConfig | None = None, *,
                 files: NodeFiles | None = None) -> None:
        """``files``: what ``config`` names, already loaded (``NodeFiles.load(config)``);
        None: ``serve`` loads it.

        ``TypeError`` for anything but a ``BrokerConfig`` (a dict, say): said here, not as
        an ``AttributeError`` from deep inside ``serve`` when it starts.
        """
        if config is not None and not isinstance(config, BrokerConfig):
            raise TypeError(f"config must be a mqttring.BrokerConfig, not "
                            f"{type(config).__name__} (BrokerConfig.from_mapping() builds "
                            "one from a dict)")
        super().__init__(config, cluster=DataPlane, files=files)
        #: The bound port of the HTTP API (``config.http``), once serving; None when off.
        self.http_port: int | None = None

    async def serve(
        self, *, task_status: trio.TaskStatus[BoundPorts] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The node, then its HTTP listener, in one nursery: cancelling it stops both."""
        if self.config.data_dir is not None:
            await trio.to_thread.run_sync(check_data_dir, self.config.data_dir)
        async with trio.open_nursery() as nursery:
            ports = await nursery.start(super().serve)
            if self.config.http is not None:
                from mqttring.http.server import serve_http  # its libraries load only if used
                self.http_port = await nursery.start(serve_http, self)
            task_status.started(ports)


def check_data_dir(data_dir: Path) -> None:
    """Create ``data_dir`` and its store directory if missing and prove both writable, or
    raise ``ConfigError`` naming the path (blocking: run it in a thread).

    Without it a data directory that is a file, or one that cannot be created or written,
    failed deep inside the store (or Raft) with a bare ``NotADirectoryError``,
    ``FileNotFoundError`` or ``PermissionError`` and a traceback, where an embedding
    program, or an operator, wants one line naming the setting.
    """
    path = Path(data_dir)
    try:
        for directory in (path, path / "store"):
            if directory.exists() and not directory.is_dir():  # mkdir says "file exists"
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR),
                                         str(directory))
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=directory):
                pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        where = f": {exc.filename}" if exc.filename and str(exc.filename) != str(path) else ""
        raise ConfigError(f'data_dir = "{path}": cannot be used as the node\'s data directory '
                          f"({reason[:1].lower()}{reason[1:]}{where})") from None


__all__ = ["BoundPorts", "MqttRingBroker", "check_data_dir"]
