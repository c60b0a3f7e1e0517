"""The life of a node process: start, serve, reload on SIGHUP, leave and stop on a signal.

``python -m mqttring.node`` runs one ``NodeLifecycle``.  Signals are watched from the first
moment (a node still importing, opening its store or joining its cluster must stop when told
to: those before trio ran are held by ``mqttring.stop_signals`` and acted on here first),
and what a stop signal does depends on the stage the node is in:

* ``STARTING`` (store, cluster join, listeners): stop at once.  A node that is not yet a
  member has nothing to hand away (if a leader had already admitted it, failure detection
  marks it down after ``failure_grace``).
* ``SERVING``: a cluster member with ``leave_on_stop`` leaves first (``BrokerNode.
  leave_cluster``: shards handed away, out of Raft; bounded by ``leave_timeout`` + 15 s);
  then the node stops.
* ``LEAVING``: a second SIGINT/SIGTERM cuts the leave short and stops now.
* ``STOPPING``: clients are disconnected, sessions written, the store and Raft closed.

From the first stop signal a watchdog thread bounds the whole stop (the leave's bound plus
``STOP_GRACE``): past it the process logs an error and exits with ``ExitCode.STOP_TIMEOUT``
(a thread stuck in pysyncobj or LMDB cannot be cancelled).

SIGHUP reloads the config file (``mqttring.reload``): one info line per applied change, one
line for changes that need a restart; an invalid file is reported in one line and changes
nothing.  A remote ``mqttring leave`` ends ``serve`` by itself; the process then exits 0.

Exit codes are ``ExitCode`` (documented in docs/operations.md).
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from mqttring.broker.files import NodeFiles
from mqttring.broker.server import LEAVE_SLACK
from mqttring.config import BrokerConfig, ConfigError
from mqttring.embedded import MqttRingBroker
from mqttring.logs import set_level
from mqttring.reload import plan_reload
from mqttring.stop_signals import HeldSignals

log = logging.getLogger("mqttring.node")

#: Seconds a stop may take past the leave (closing clients, writing sessions, the store).
STOP_GRACE = 20.0


class ExitCode(enum.IntEnum):
    OK = 0  # stopped by a signal or after ``mqttring leave``
    FAILED = 1  # could not start (address in use, join failed) or failed while serving
    CONFIG = 2  # configuration error
    LEAVE_INCOMPLETE = 3  # stopped, but the leave did not complete (still listed a member)
    STOP_TIMEOUT = 4  # the stop exceeded its bound; the watchdog ended the process
    STORE_FAILED = 5  # the node store failed (disk full, I/O error) and the node stopped


class Stage(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    LEAVING = "leaving"
    STOPPING = "stopping"


#: Reads the config again for a reload (file plus the same flags); None: no ``--config``.
ConfigLoader = Callable[[], BrokerConfig]


class NodeLifecycle:
    def __init__(self, config: BrokerConfig, *, ready_file: Path | None = None,
                 reload_config: ConfigLoader | None = None,
                 on_started: Callable[[], None] | None = None,
                 files: NodeFiles | None = None,
                 held: HeldSignals | None = None) -> None:
        self.broker = MqttRingBroker(config, files=files)
        self.held = held
        self.ready_file = ready_file
        self.reload_config = reload_config
        self.on_started = on_started
        self.stage = Stage.STARTING
        self.exit_code = ExitCode.OK
        self._watchdog: threading.Timer | None = None

    async def run(self) -> ExitCode:
        """Serve until a stop signal or a remote leave; raises what made the start fail."""
        try:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM,
                                           signal.SIGHUP) as signals:
                async with trio.open_nursery() as nursery:
                    # After the receiver is open, so that no signal falls between the two.
                    early = self.held.take() if self.held is not None else []
                    for signum in early:
                        if signum != signal.SIGHUP:
                            self._on_stop_signal(signal.Signals(signum).name, nursery)
                    if self.stage is Stage.STARTING:
                        nursery.start_soon(self._start, nursery)
                        if signal.SIGHUP in early:  # as if it came now
                            await self.reload()
                    async for signum in signals:
                        if signum == signal.SIGHUP:
                            await self.reload()
                        else:
                            self._on_stop_signal(signal.Signals(signum).name, nursery)
        finally:
            if self._watchdog is not None:
                self._watchdog.cancel()
        return self.exit_code

    async def _start(self, nursery: trio.Nursery) -> None:
        broker = self.broker
        ports = await nursery.start(broker.serve)
        if self.stage is not Stage.STARTING:
            return  # a stop signal came first
        self.stage = Stage.SERVING
        if self.on_started is not None:
            self.on_started()
        if self.ready_file is not None:
            config = broker.config
            _write_ready_file(self.ready_file, {
                "mqtt": ports.mqtt, "ws": ports.ws, "mqtts": ports.mqtts, "wss": ports.wss,
                "pid": os.getpid(),
                "node_id": config.node_id, "cluster": config.cluster,
                "admin": broker.admin_port, "http": broker.http_port})
        await broker.wait_left()  # an operator's ``mqttring leave``: the process ends too
        log.info("node %s stopped after leaving the cluster", broker.config.node_id)
        self.stage = Stage.STOPPING
        nursery.cancel_scope.cancel()

    def _on_stop_signal(self, name: str, nursery: trio.Nursery) -> None:
        config = self.broker.config
        if self.stage is Stage.LEAVING:
            log.warning("signal %s while leaving: stopping without waiting for the leave", name)
            self.exit_code = ExitCode.LEAVE_INCOMPLETE
            self._stop(nursery)
            return
        if self.stage is Stage.STOPPING:
            log.info("signal %s: already stopping", name)
            return
        log.info("signal %s: shutting down (%s)", name, self.stage.value)
        leaving = (self.stage is Stage.SERVING and self.broker.plane is not None
                   and config.leave_on_stop)
        self._arm_watchdog((config.leave_timeout + LEAVE_SLACK if leaving else 0) + STOP_GRACE)
        if leaving:
            self.stage = Stage.LEAVING
            nursery.start_soon(self._leave_then_stop, nursery)
        else:
            self._stop(nursery)

    async def _leave_then_stop(self, nursery: trio.Nursery) -> None:
        if not await self.broker.leave_cluster():
            self.exit_code = ExitCode.LEAVE_INCOMPLETE
        self._stop(nursery)

    def _stop(self, nursery: trio.Nursery) -> None:
        self.stage = Stage.STOPPING
        nursery.cancel_scope.cancel()

    def _arm_watchdog(self, seconds: float) -> None:
        def expire() -> None:
            log.error("stop did not finish within %.0f s; exiting now", seconds)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(ExitCode.STOP_TIMEOUT)

        self._watchdog = threading.Timer(seconds, expire)
        self._watchdog.daemon = True
        self._watchdog.start()

    async def reload(self) -> None:
        """SIGHUP: apply what may change live from the config file; see ``mqttring.reload``."""
        if self.reload_config is None:
            # Settings come from flags only and cannot change; the files they name can
            # (renewed certificates, a new password or ACL file under the same name).
            log.info("SIGHUP: no --config file, settings unchanged; re-reading the password, "
                     "ACL and certificate files")
            with contextlib.suppress(ConfigError):
                await trio.to_thread.run_sync(self.broker.reload_files)
            return
        try:
            new = await trio.to_thread.run_sync(self.reload_config)
            plan = plan_reload(self.broker.config, new)
        except ConfigError as exc:
            log.error("SIGHUP: config not reloaded, still running with the old one: %s", exc)
            return
        if plan.applied:
            try:
                self.broker.apply_settings(plan.config)
            except ConfigError as exc:
                log.error("SIGHUP: config not reloaded, still running with the old one: %s",
                          exc)
                return
            set_level(plan.config.log_level)
        # A file that does not parse is logged by the reload and its previous rules stay.
        files = "the password, ACL and certificate files re-read"
        try:
            await trio.to_thread.run_sync(self.broker.reload_files)
        except ConfigError:
            files = "a file named in it kept its previous contents (logged above)"
        for change in plan.applied:
            log.info("reloaded: %s", change.describe())
        if plan.needs_restart:
            log.warning("changed in the config file but not applied (need a restart): %s",
                        ", ".join(plan.needs_restart))
        if not plan.applied and not plan.needs_restart:
            # Not "nothing changed": the files it names may have (a new password file).
            log.info("SIGHUP: config reloaded, no setting changed; %s", files)


def _write_ready_file(path: Path, info: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)  # atomic: readers never see half a file


__all__ = ["ExitCode", "NodeLifecycle", "Stage"]
