"""``python -m mqttring.node --workers N``: one node process per core, as one cluster.

A Python process uses one core; a broker box has many.  The supervisor started by
``--workers`` runs N ordinary node processes that form (or join) one cluster and share the
MQTT and WebSocket ports through ``SO_REUSEPORT`` (the kernel spreads new connections over
them), so one command, one address and one data directory use the whole machine.  Nothing
here is special to workers: each is a full cluster member (Raft, ring, links), and clients
see one broker whichever worker the kernel hands them to.

What the supervisor decides, per worker ``i``:

* node id ``<node_id>-w<i>``, data directory ``<data_dir>/w<i>`` (stable across restarts, so
  a restarted worker rejoins as itself and finds its sessions and retained messages);
* cluster address: ``--cluster HOST:PORT`` gives worker ``i`` ports ``PORT + 2i`` (links)
  and ``PORT + 2i + 1`` (Raft); without ``--cluster`` the workers form a private cluster on
  loopback with free ports and a random secret;
* worker 0 forms the cluster, or joins ``--join``; the others join worker 0;
* an MQTT or WebSocket port 0 is replaced by one free port that all workers share.

What it picked is kept in ``<data_dir>/workers.json`` (secret included, mode 0600) and used
again on the next start, so that a stopped machine comes back as the same cluster at the
same addresses: the workers rejoin each other from their Raft journals and find their data.
All workers start at once (a restarted one waits for the others' Raft to elect a leader);
the supervisor reports ready once every worker is.  Another worker count on the same data
directory is refused (growing or shrinking in place is not supported yet).

Signals, held from before the first worker is started (so a signal at any stage reaches
every worker already running, never killing the supervisor alone): SIGINT/SIGTERM are
passed to every worker, which stop without leaving the cluster (``leave_on_stop = false``:
they stop together and come back together, so there is nobody to hand shards to); past
``leave_timeout`` + a slack a worker is killed.  SIGHUP is passed on too: each worker
reloads the config file (``mqttring.lifecycle``); one that comes while the workers start is
passed on once they are ready.  A worker that dies on its own is started again (at most
``MAX_RESTARTS`` times a minute), as a crashed node would be by an init system; past that the
supervisor stops every worker and exits 1, for its own process manager to restart the set
(the others alone may lack a Raft majority, refusing every client).

The workers die with the supervisor, even with a SIGKILL: each inherits the read end of a
pipe whose write end only the supervisor holds, and stops itself (as on SIGTERM) when it
reads EOF there (``worker_main``), so no orphan keeps the port from the next start.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from mqttring.config import ENV_PREFIX, BrokerConfig, ConfigError, parse_hostport
from mqttring.lifecycle import ExitCode
from mqttring.stop_signals import HeldSignals, hold

log = logging.getLogger("mqttring.workers")

#: Flags the supervisor decides for each worker (or keeps for itself).
OWN_FLAGS = {"workers", "ready_file", "node_id", "data_dir", "mqtt", "ws", "cluster", "raft",
             "join", "cluster_secret", "admin"}
READY_SECONDS = 60.0
STOP_SLACK = 10.0
MAX_RESTARTS = 5
SECRET_ENV = "MQTTRING_CLUSTER_SECRET"
STATE_FILE = "workers.json"
#: How a worker process starts (``python -c``): stop signals held before any import
#: (``mqttring.stop_signals``), then ``mqttring.node`` tied to its supervisor.
WORKER_BOOT = ("import sys; from mqttring.stop_signals import hold; hold(); "
               "from mqttring.workers import worker_main; sys.exit(worker_main(sys.argv[1:]))")
#: Seconds an orphaned worker gets to stop on its own SIGTERM before it kills itself.
ORPHAN_KILL_AFTER = 60.0


#: Where ``lasting_port`` looks when the kernel's ephemeral range leaves no room below it.
LASTING_PORTS = (10000, 32767)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default; elsewhere only a hint


def lasting_port(host: str = "127.0.0.1", taken: frozenset[int] = frozenset()) -> int:
    """A port free now and outside the kernel's ephemeral range, to be written into
    ``workers.json`` and bound again at every start.

    A port the kernel handed out for binding port 0 comes from the range it also gives
    outgoing connections their local ports from: one of those (or its TIME_WAIT) on the
    saved port made a later start fail with "address already in use" (a probe showed it).
    Ports below the range are never taken behind our back."""
    import random
    import socket

    low, _ = _ephemeral_range()
    first, last = LASTING_PORTS
    last = min(last, low - 1) if low - 1 > first else last
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(first, last)
        if port in taken:
            continue
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError:
                continue
        return port
    raise ConfigError(f"no free port in {first}-{last} on {host} for the workers' cluster")


def worker_count(text: str) -> int:
    """``--workers`` value: a positive number, or ``auto`` (one per core)."""
    if text == "auto":
        return os.cpu_count() or 1
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--workers takes a number or 'auto', not {text!r}"
                                         ) from None
    if count < 1:
        raise argparse.ArgumentTypeError("--workers must be at least 1")
    return count


@dataclass
class Worker:
    index: int
    node_id: str
    data_dir: Path
    cluster: str
    raft: str
    join: str | None
    ready_file: Path
    process: trio.Process | None = None
    info: dict[str, Any] = field(default_factory=dict)
    restarts: list[float] = field(default_factory=list)


@dataclass
class Plan:
    """Everything the supervisor derived from the configuration."""

    config: BrokerConfig
    workers: list[Worker]
    passed_flags: list[str]
    env: dict[str, str]
    #: The MQTT / WebSocket address every worker binds (port 0 resolved).
    mqtt: str
    ws: str | None


def plan(config: BrokerConfig, count: int, args: argparse.Namespace, run_dir: Path) -> Plan:
    if config.mqtt is None:
        raise ConfigError("--workers needs an MQTT listener (mqtt = HOST:PORT)")
    if config.data_dir is None:
        raise ConfigError("--workers needs a data directory (each worker keeps its own there)")
    state_file = config.data_dir / STATE_FILE
    try:
        stored = json.loads(state_file.read_text())
    except FileNotFoundError:
        stored = None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"unreadable {state_file}: {exc}") from None
    if stored is not None and len(stored.get("workers", [])) != count:
        raise ConfigError(f"{config.data_dir} holds a cluster of {len(stored['workers'])} "
                          f"workers, not {count}: start it with that count (or use a new "
                          "data directory)")
    for name in ("mqtts", "wss"):
        address = getattr(config, name)
        if address is not None and parse_hostport(address)[1] == 0:
            raise ConfigError(f"--workers needs a fixed {name} port (with port 0 every worker "
                              "would listen on a different one)")
    secret = config.cluster_secret or (stored or {}).get("secret")
    picked: set[int] = set()

    def free_port(host: str = "127.0.0.1") -> int:
        port = lasting_port(host, frozenset(picked))
        picked.add(port)
        return port

    mqtt_host, mqtt_port = parse_hostport(config.mqtt)
    mqtt_port = mqtt_port or (stored or {}).get("mqtt_port") or free_port(mqtt_host)
    ws = None
    if config.ws is not None:
        ws_host, ws_port = parse_hostport(config.ws)
        ws = f"{ws_host}:{ws_port or (stored or {}).get('ws_port') or free_port(ws_host)}"
    if config.cluster is not None:
        host, base = parse_hostport(config.cluster)
        if secret is None:
            raise ConfigError("--workers with --cluster needs the cluster's secret "
                              f"(--cluster-secret or {SECRET_ENV})")
        addresses = [(f"{host}:{base + 2 * i}", f"{host}:{base + 2 * i + 1}") if base
                     else (f"{host}:{free_port(host)}", f"{host}:{free_port(host)}")
                     for i in range(count)]
    elif stored is not None:
        addresses = [(w["cluster"], w["raft"]) for w in stored["workers"]]
    else:
        addresses = [(f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")
                     for _ in range(count)]
    secret = secret or secrets.token_hex(16)
    workers = [Worker(index=i, node_id=f"{config.node_id}-w{i}",
                      data_dir=config.data_dir / f"w{i}", cluster=link, raft=raft,
                      join=config.join if i == 0 else addresses[0][0],
                      ready_file=run_dir / f"w{i}.ready")
               for i, (link, raft) in enumerate(addresses)]
    config.data_dir.mkdir(parents=True, exist_ok=True)
    _write_json(state_file, {
        "secret": secret, "mqtt_port": mqtt_port,
        "ws_port": None if ws is None else parse_hostport(ws)[1],
        "workers": [{"node_id": w.node_id, "cluster": w.cluster, "raft": w.raft}
                    for w in workers]}, private=True)
    passed: list[str] = []
    for name, value in sorted(vars(args).items()):
        if name in OWN_FLAGS or value is None or value is False or name == "func":
            continue
        flag = f"--{name.replace('_', '-')}"
        passed += [flag] if value is True else [flag, str(value)]
    # What the supervisor decides per worker must not reach a worker from the environment
    # (MQTTRING_ADMIN would have every worker bind one port; MQTTRING_WS a port it turned off).
    own_env = {f"{ENV_PREFIX}{name.upper()}" for name in OWN_FLAGS}
    env = {k: v for k, v in os.environ.items() if k not in own_env}
    return Plan(config, workers, passed, {**env, SECRET_ENV: secret},
                f"{mqtt_host}:{mqtt_port}", ws)


def _command(plan: Plan, worker: Worker, lifeline: int) -> list[str]:
    """The worker's command line: ``mqttring.node`` behind :func:`worker_main`, which stops
    the worker when the supervisor's end of ``lifeline`` (an fd the worker inherits) closes."""
    cmd = [sys.executable, "-c", WORKER_BOOT, str(lifeline), *plan.passed_flags,
           "--node-id", worker.node_id, "--data-dir", str(worker.data_dir),
           "--mqtt", plan.mqtt, "--cluster", worker.cluster, "--raft", worker.raft,
           "--ready-file", str(worker.ready_file), "--reuse-port", "--stay-on-stop"]
    if plan.ws is not None:
        cmd += ["--ws", plan.ws]
    if worker.join is not None:
        cmd += ["--join", worker.join]
    return cmd


class StartError(RuntimeError):
    """A worker could not be started, or exited (or hung) before it was ready."""


async def _wait_ready(worker: Worker, deadline: float) -> None:
    while True:
        process = worker.process
        assert process is not None
        if process.returncode is not None:
            raise StartError(f"worker {worker.node_id} exited with {process.returncode} "
                             "before it was ready")
        try:
            worker.info = json.loads(worker.ready_file.read_text())
            return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        if trio.current_time() > deadline:
            raise StartError(f"worker {worker.node_id} not ready in {READY_SECONDS}s")
        await trio.sleep(0.05)


class Supervisor:
    """Starts the workers, passes signals on, restarts a crashed worker, stops them all.

    Signals are received from the first moment of :meth:`run`, before any worker exists:
    a stop signal that arrives while the workers start must stop the ones already started
    (with the default disposition the supervisor would die alone and leave them serving).
    """

    def __init__(self, plan: Plan, ready_file: Path | None) -> None:
        self.plan = plan
        self.ready_file = ready_file
        self.stopping = False
        self.ready = False
        #: A SIGHUP that came while the workers started, passed on once they are ready.
        self.hup_pending = False
        self.exit_code = ExitCode.OK
        #: Why the supervisor failed (one line for stderr), or None.
        self.error: str | None = None
        self._scope: trio.CancelScope | None = None
        #: Workers whose process is being created: already visible as children of this
        #: process, not yet in ``_running()``; counted when a stop signal is logged.
        self._creating = 0
        # The lifeline: every worker inherits the read end, only this process holds the
        # write end (os.pipe() fds are not inheritable), so when this process ends, however
        # it ends (kill -9 included), each worker reads EOF and stops (``worker_main``).
        self._lifeline_read, self._lifeline_write = os.pipe()

    def _running(self) -> list[trio.Process]:
        return [w.process for w in self.plan.workers
                if w.process is not None and w.process.returncode is None]

    async def _start(self, worker: Worker) -> None:
        worker.ready_file.unlink(missing_ok=True)
        try:
            worker.data_dir.mkdir(parents=True, exist_ok=True)
            # Shielded: a stop signal while the process is being created must not lose it
            # (then ``_stop_all`` would not know about it).
            with trio.CancelScope(shield=True):
                self._creating += 1
                try:
                    worker.process = await trio.lowlevel.open_process(
                        _command(self.plan, worker, self._lifeline_read),
                        env=self.plan.env, pass_fds=(self._lifeline_read,))
                finally:
                    self._creating -= 1
        except OSError as exc:
            raise StartError(f"cannot start worker {worker.node_id}: {exc}") from None

    async def run(self, held: HeldSignals | None = None) -> ExitCode:
        """Run until a stop signal, or until a worker cannot be kept running; the exit code.

        ``held``: signals that came before this ran (``mqttring.stop_signals``).
        """
        try:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM,
                                           signal.SIGHUP) as signals:
                # After the receiver is open, so that no signal falls between the two.
                early = [s for s in (held.take() if held else ()) if s != signal.SIGHUP]
                if early:  # a SIGHUP before any worker started: they read the file anyway
                    log.info("signal %s: stopping before any worker started",
                             signal.Signals(early[0]).name)
                    return self.exit_code
                try:
                    async with trio.open_nursery() as nursery:
                        self._scope = nursery.cancel_scope
                        nursery.start_soon(self._on_signals, signals)
                        if await self._start_all():
                            for worker in self.plan.workers:
                                nursery.start_soon(self._watch, worker)
                        else:
                            nursery.cancel_scope.cancel()
                finally:
                    self.stopping = True
                    with trio.CancelScope(shield=True):
                        await self._stop_all()
        finally:
            os.close(self._lifeline_write)
            os.close(self._lifeline_read)
        return self.exit_code

    async def _start_all(self) -> bool:
        """Start every worker and wait until each is ready; False (``error`` set) if not."""
        workers = self.plan.workers
        deadline = trio.current_time() + READY_SECONDS
        try:
            for worker in workers:
                await self._start(worker)
            for worker in workers:
                await _wait_ready(worker, deadline)
        except StartError as exc:
            self.error = f"workers did not start: {exc}"
            self.exit_code = ExitCode.FAILED
            return False
        log.info("%d workers serving mqtt=%s ws=%s: %s", len(workers), self.plan.mqtt,
                 self.plan.ws,
                 ", ".join(f"{w.node_id} (pid {w.info['pid']})" for w in workers))
        if self.ready_file is not None:
            first = workers[0]
            _write_json(self.ready_file, {
                "mqtt": first.info["mqtt"], "ws": first.info.get("ws"),
                "mqtts": first.info.get("mqtts"), "wss": first.info.get("wss"),
                "pid": os.getpid(), "node_id": self.plan.config.node_id,
                "workers": [w.info for w in workers]})
        self.ready = True
        if self.hup_pending:
            self._pass_hup()
        return True

    async def _on_signals(self, signals: AsyncIterator[int]) -> None:
        """SIGHUP: passed on (once every worker is ready); SIGINT/SIGTERM: stop them all."""
        async for signum in signals:
            if signum == signal.SIGHUP:
                if self.ready:
                    self._pass_hup()
                else:
                    # A worker still importing would die of it (Python's default for
                    # SIGHUP); one already running reloads after it has read the file.
                    log.info("SIGHUP while the workers start: passing it on once they are "
                             "ready")
                    self.hup_pending = True
                continue
            log.info("signal %s: stopping %d workers%s", signal.Signals(signum).name,
                     len(self._running()) + self._creating,
                     "" if self.ready else " (starting)")
            self._stop()
            return

    def _pass_hup(self) -> None:
        running = self._running()
        log.info("SIGHUP: passing it on to %d workers", len(running))
        for process in running:
            process.send_signal(signal.SIGHUP)

    def _stop(self) -> None:
        self.stopping = True
        assert self._scope is not None
        self._scope.cancel()

    async def _watch(self, worker: Worker) -> None:
        """Start a worker again when it dies on its own (bounded per minute).

        Past the bound the supervisor stops every worker and fails (exit 1): the others
        alone may lack a Raft majority and refuse every client while the supervisor looks
        healthy, so it is better left to the process manager to restart the whole set.
        """
        while True:
            process = worker.process
            assert process is not None
            code = await process.wait()
            if self.stopping:
                return
            now = time.monotonic()
            worker.restarts = [t for t in worker.restarts if now - t < 60] + [now]
            if len(worker.restarts) > MAX_RESTARTS:
                log.error("worker %s exited with %s; %d restarts within a minute, giving up: "
                          "stopping every worker", worker.node_id, code, MAX_RESTARTS)
                self.error = (f"workers stopped: worker {worker.node_id} exited "
                              f"{MAX_RESTARTS + 1} times within a minute (last with {code})")
                self.exit_code = ExitCode.FAILED
                self._stop()
                return
            log.error("worker %s exited with %s; starting it again", worker.node_id, code)
            await trio.sleep(1.0)
            worker.join = self.plan.workers[0].cluster if worker.index else worker.join
            try:
                await self._start(worker)
            except StartError as exc:
                log.error("%s: stopping every worker", exc)
                self.error = f"workers stopped: {exc}"
                self.exit_code = ExitCode.FAILED
                self._stop()
                return

    async def _stop_all(self) -> None:
        running = self._running()
        for process in running:
            process.send_signal(signal.SIGTERM)
        with trio.move_on_after(self.plan.config.leave_timeout + STOP_SLACK):
            for process in running:
                await process.wait()
        for process in running:
            if process.returncode is None:
                log.error("worker pid %d did not stop in time; killing it", process.pid)
                process.kill()
                await process.wait()


def _write_json(path: Path, info: dict[str, Any], private: bool = False) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.touch(mode=0o600 if private else 0o644)
    tmp.write_text(json.dumps(info))
    tmp.replace(path)


def run_workers(config: BrokerConfig, count: int, args: argparse.Namespace,
                held: HeldSignals | None = None) -> int:
    """The supervisor process.  ``held``: the node command's held stop signals (held from
    the process's start, ``mqttring.stop_signals``): a signal while the plan is made is
    kept for the supervisor, instead of killing this process or raising KeyboardInterrupt.
    """
    held = held or hold()
    with tempfile.TemporaryDirectory(prefix="mqttring-workers-") as run_dir:
        try:
            the_plan = plan(config, count, args, Path(run_dir))
        except ConfigError as exc:
            print(f"mqttring: configuration error: {exc}", file=sys.stderr)
            return ExitCode.CONFIG
        supervisor = Supervisor(the_plan, args.ready_file)
        code = trio.run(supervisor.run, held)
        if supervisor.error is not None:
            print(f"mqttring: {supervisor.error}", file=sys.stderr)
        return int(code)


def worker_main(argv: list[str]) -> int:
    """A worker process (``WORKER_BOOT``): ``argv`` is the lifeline fd, then node flags.

    A thread waits for EOF on the lifeline, which comes when the supervisor has ended; the
    worker then stops as on SIGTERM (without leaving, ``--stay-on-stop``), so a supervisor
    killed with SIGKILL leaves no worker holding the port.  Not ``PR_SET_PDEATHSIG``: trio
    creates processes from a worker thread, and the kernel sends that signal when the
    *thread* that forked ends (trio's idle threads do, after a few seconds).
    """
    lifeline = int(argv[0])

    def wait_for_the_supervisor() -> None:
        try:
            while os.read(lifeline, 1):  # nothing is ever written: this returns at EOF
                pass
        except OSError as exc:  # not a pipe from a supervisor: nothing to watch
            log.warning("cannot watch the workers' supervisor: %s", exc)
            return
        log.warning("the workers' supervisor is gone: stopping")
        os.kill(os.getpid(), signal.SIGTERM)
        # The node bounds its own stop; this only covers a process that ignored SIGTERM.
        time.sleep(ORPHAN_KILL_AFTER)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait_for_the_supervisor, name="mqttring-lifeline",
                     daemon=True).start()
    from mqttring.node import main  # here: mqttring.node imports this module

    return main(argv[1:])
