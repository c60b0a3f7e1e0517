"""Shared fixtures for the end-to-end tests: real brokers on free ports, real clients.

What is here and why:

* ``broker`` / ``broker_factory``: an in-process ``MqttRingBroker`` (background trio thread via
  ``start()``/``stop()``) bound to port 0 on loopback, with a ``tmp_path`` data dir, ``$SYS``
  every second, a WebSocket listener and optional ``Limits``.  Stopped at teardown.
* ``node_factory``: the same broker as a separate ``python -m mqttring.node`` process, started
  from a ``--ready-file``, so it can be SIGTERMed (clean restart) or SIGKILLed (crash test)
  and restarted on the same data dir.
* ``paho``: a factory of paho-mqtt clients whose every wait is bounded (``queue.get(timeout)``)
  and which are all disconnected at teardown.  ``raw``: a factory of ``RawClient`` sockets
  (``tests/mqtt_client.py``) for what paho cannot do.

The mqttring imports happen inside the fixtures, so the unit tests sharing this conftest keep
working even while the broker package is incomplete.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

#: The cluster tests' fixtures (``fresh_cluster``, ``clients``) live with their helpers.
pytest_plugins = ("cluster_support",)

HOST = "127.0.0.1"
WAIT = 5.0  # default bound for "this must arrive" waits


# --------------------------------------------------------------------------- brokers


@dataclass
class BrokerHandle:
    """Where a running broker listens."""

    host: str
    port: int
    ws_port: int | None
    data_dir: Path


def _start_inprocess(data_dir: Path, sys_interval: float, ws: bool, limits: dict[str, Any],
                     settings: dict[str, Any] | None = None):
    from mqttring import BrokerConfig, Limits, MqttRingBroker

    config = BrokerConfig(
        **(settings or {}),
        node_id=f"t-{uuid.uuid4().hex[:6]}",
        mqtt=f"{HOST}:0",
        ws=f"{HOST}:0" if ws else None,
        data_dir=data_dir,
        sys_interval=sys_interval,
        limits=Limits(**limits),
    )
    broker = MqttRingBroker(config)
    ports = broker.start()
    assert ports.mqtt, f"broker.start() returned no MQTT port: {ports!r}"
    if ws:
        assert ports.ws, f"broker.start() returned no WebSocket port: {ports!r}"
    return broker, BrokerHandle(HOST, ports.mqtt, ports.ws, data_dir)


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator[Callable[..., BrokerHandle]]:
    """``start(sys_interval=1.0, ws=True, settings=None, **limits) -> BrokerHandle``
    (``settings``: other ``BrokerConfig`` fields); all stopped at teardown."""
    running: list[Any] = []
    counter = itertools.count()

    def start(sys_interval: float = 1.0, ws: bool = True,
              settings: dict[str, Any] | None = None, **limits: Any) -> BrokerHandle:
        data_dir = tmp_path / f"broker{next(counter)}"
        data_dir.mkdir()
        broker, handle = _start_inprocess(data_dir, sys_interval, ws, limits, settings)
        running.append(broker)
        return handle

    yield start
    for broker in reversed(running):
        broker.stop()


@pytest.fixture
def broker(broker_factory: Callable[..., BrokerHandle]) -> BrokerHandle:
    """A broker with default limits, WebSocket listener and $SYS every second."""
    return broker_factory()


# --------------------------------------------------------------------------- node process


class NodeProcess:
    """``python -m mqttring.node`` in its own process, restartable on the same data dir."""

    def __init__(self, data_dir: Path, log_path: Path, node_id: str, ws: bool) -> None:
        self.data_dir = data_dir
        self.log_path = log_path
        self.node_id = node_id
        self.ws = ws
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.ws_port: int | None = None
        self.pid = 0
        self.starts = 0
        #: More command-line flags for the node (``--password-file F``, ...).
        self.extra_args: list[str] = []
        #: Run in the node's process before it starts (resource limits).
        self.preexec: Callable[[], None] | None = None

    @property
    def handle(self) -> BrokerHandle:
        return BrokerHandle(HOST, self.port, self.ws_port, self.data_dir)

    def start(self, timeout: float = 30.0) -> BrokerHandle:
        assert self.proc is None or self.proc.poll() is not None, "node already running"
        self.starts += 1
        ready = self.data_dir.parent / f"{self.node_id}-ready-{self.starts}.json"
        cmd = [
            sys.executable, "-m", "mqttring.node",
            "--node-id", self.node_id,
            "--mqtt", f"{HOST}:0",
            "--data-dir", str(self.data_dir),
            "--sys-interval", "1",
            "--log-level", "info",
            "--ready-file", str(ready),
        ]  # fmt: skip
        if self.ws:
            cmd += ["--ws", f"{HOST}:0"]
        cmd += self.extra_args
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== start {self.starts}: {' '.join(cmd)}\n".encode())
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=self.preexec)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"node exited with {self.proc.returncode} before ready:\n{self.log_tail()}"
                )
            try:
                info = json.loads(ready.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                time.sleep(0.05)
                continue
            self.port, self.ws_port, self.pid = info["mqtt"], info.get("ws"), info["pid"]
            assert self.pid == self.proc.pid, f"ready file pid {self.pid} != {self.proc.pid}"
            return self.handle
        self.kill9()
        raise AssertionError(f"node not ready within {timeout}s:\n{self.log_tail()}")

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait; returns the exit code (the contract says 0)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise AssertionError(
                f"node ignored SIGTERM for {timeout}s:\n{self.log_tail()}"
            ) from None

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"


@pytest.fixture
def node_factory(tmp_path: Path) -> Iterator[Callable[..., NodeProcess]]:
    """``make(ws=False) -> NodeProcess`` (not yet started); every node is killed at teardown."""
    nodes: list[NodeProcess] = []

    def make(ws: bool = False) -> NodeProcess:
        index = len(nodes)
        data_dir = tmp_path / f"node{index}-data"
        data_dir.mkdir()
        node = NodeProcess(data_dir, tmp_path / f"node{index}.log", f"n{index}", ws)
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.kill9()


# --------------------------------------------------------------------------- paho clients


class PahoClient:
    """A paho-mqtt 3.1.1 client with bounded waits and no automatic reconnect."""

    def __init__(
        self,
        broker: BrokerHandle,
        client_id: str = "",
        clean_session: bool = True,
        transport: str = "tcp",
    ) -> None:
        import paho.mqtt.client as mqtt

        self.broker = broker
        self.transport = transport
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=client_id,
            clean_session=clean_session,
            protocol=mqtt.MQTTv311,
            transport=transport,  # type: ignore[arg-type]
            reconnect_on_failure=False,
        )
        if transport == "websockets":
            self.client.ws_set_options(path="/mqtt")
        self.messages: queue.Queue[Any] = queue.Queue()
        self.connacks: queue.Queue[tuple[bool, int]] = queue.Queue()
        self.subacks: queue.Queue[tuple[int, list[int]]] = queue.Queue()
        self.unsubacks: queue.Queue[int] = queue.Queue()
        self.disconnected = threading.Event()
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.client.on_unsubscribe = self._on_unsubscribe
        self.client.on_disconnect = self._on_disconnect
        self.looping = False

    # paho callbacks (run in paho's network thread)
    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connacks.put((bool(flags.session_present), int(reason_code.value)))

    def _on_message(self, client, userdata, msg) -> None:
        self.messages.put(msg)

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        self.subacks.put((mid, [int(rc.value) for rc in reason_codes]))

    def _on_unsubscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        self.unsubacks.put(mid)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.disconnected.set()

    # actions
    def connect(
        self,
        keepalive: int = 30,
        will: tuple[str, bytes, int, bool] | None = None,
        timeout: float = WAIT,
    ) -> bool:
        """Connect, wait for CONNACK 0 and return session-present."""
        if will is not None:
            topic, payload, qos, retain = will
            self.client.will_set(topic, payload, qos, retain)
        port = self.broker.ws_port if self.transport == "websockets" else self.broker.port
        assert port, "broker has no listener for this transport"
        self.disconnected.clear()
        self.client.connect(self.broker.host, port, keepalive)
        self.client.loop_start()
        self.looping = True
        try:
            session_present, rc = self.connacks.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no CONNACK within {timeout}s") from None
        assert rc == 0, f"CONNACK refused: {rc}"
        return session_present

    def subscribe(self, topic: str | list[tuple[str, int]], qos: int = 0) -> list[int]:
        """Subscribe and return the granted QoS list from the SUBACK."""
        result, mid = self.client.subscribe(topic, qos) if isinstance(topic, str) else (
            self.client.subscribe(topic)
        )
        assert result == 0, f"paho could not send SUBSCRIBE: {result}"
        deadline = time.monotonic() + WAIT
        while True:
            try:
                got_mid, codes = self.subacks.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                raise AssertionError(f"no SUBACK for {topic!r} within {WAIT}s") from None
            if got_mid == mid:
                return codes

    def unsubscribe(self, topic: str) -> None:
        result, mid = self.client.unsubscribe(topic)
        assert result == 0
        deadline = time.monotonic() + WAIT
        while True:
            try:
                got = self.unsubacks.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                raise AssertionError(f"no UNSUBACK for {topic!r} within {WAIT}s") from None
            if got == mid:
                return

    def publish(
        self, topic: str, payload: bytes | str = b"", qos: int = 0, retain: bool = False,
        wait: bool = True,
    ) -> Any:
        """Publish; by default wait until the QoS flow completed (PUBACK / PUBCOMP)."""
        info = self.client.publish(topic, payload, qos, retain)
        if wait:
            info.wait_for_publish(timeout=WAIT)
            assert info.is_published(), f"publish to {topic!r} at QoS {qos} not acknowledged"
        return info

    def get(self, timeout: float = WAIT) -> Any:
        try:
            return self.messages.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no message within {timeout}s") from None

    def collect(self, count: int, timeout: float = WAIT) -> list[Any]:
        """Exactly ``count`` messages within ``timeout`` (fails if fewer arrive)."""
        deadline = time.monotonic() + timeout
        got: list[Any] = []
        while len(got) < count:
            try:
                got.append(self.messages.get(timeout=max(deadline - time.monotonic(), 0)))
            except queue.Empty:
                summary = [(m.topic, m.payload[:40]) for m in got]
                raise AssertionError(
                    f"only {len(got)} of {count} messages within {timeout}s: {summary}"
                ) from None
        return got

    def drain(self, seconds: float) -> list[Any]:
        """All messages arriving within ``seconds`` (used to prove something did NOT arrive)."""
        deadline = time.monotonic() + seconds
        got: list[Any] = []
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return got
            try:
                got.append(self.messages.get(timeout=remaining))
            except queue.Empty:
                return got

    def clear(self) -> None:
        """Forget every message received so far."""
        while True:
            try:
                self.messages.get_nowait()
            except queue.Empty:
                return

    def disconnect(self) -> None:
        """A clean DISCONNECT (no will) and stop the network thread."""
        if self.looping:
            self.client.disconnect()
            self.disconnected.wait(WAIT)
            self.client.loop_stop()
            self.looping = False

    def close(self) -> None:
        """Stop without DISCONNECT if still running (teardown)."""
        if self.looping:
            with contextlib.suppress(Exception):
                self.client.disconnect()
            self.client.loop_stop()
            self.looping = False


@pytest.fixture
def paho(request: pytest.FixtureRequest) -> Iterator[Callable[..., PahoClient]]:
    """``make(client_id="", clean_session=True, transport="tcp", target=None)``; without a
    target the client goes to the ``broker`` fixture (started only if some client needs it)."""
    clients: list[PahoClient] = []

    def make(
        client_id: str = "",
        clean_session: bool = True,
        transport: str = "tcp",
        target: BrokerHandle | None = None,
    ) -> PahoClient:
        client = PahoClient(
            target or request.getfixturevalue("broker"), client_id, clean_session, transport
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def paho_any() -> Iterator[Callable[..., PahoClient]]:
    """Like ``paho`` but with an explicit target broker (for node-process tests)."""
    clients: list[PahoClient] = []

    def make(
        target: BrokerHandle,
        client_id: str = "",
        clean_session: bool = True,
        transport: str = "tcp",
    ) -> PahoClient:
        client = PahoClient(target, client_id, clean_session, transport)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def raw(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """``make(target=None, rcvbuf=None) -> RawClient`` (default target: the ``broker``
    fixture); sockets closed at teardown."""
    from mqtt_client import RawClient

    clients: list[RawClient] = []

    def make(target: BrokerHandle | None = None, rcvbuf: int | None = None) -> RawClient:
        t = target or request.getfixturevalue("broker")
        client = RawClient(t.host, t.port, rcvbuf=rcvbuf)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def raw5(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """``make(target=None) -> Raw5``, an MQTT 5 socket client (default target: the
    ``broker`` fixture); sockets closed at teardown."""
    from mqtt5_support import Raw5

    clients: list[Raw5] = []

    def make(target: BrokerHandle | None = None) -> Raw5:
        t = target or request.getfixturevalue("broker")
        client = Raw5(t.host, t.port)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


# --------------------------------------------------------------------------- processes


@pytest.fixture
def processes() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """``spawn(cmd) -> Popen`` with stdout piped; every process is killed at teardown."""
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(cmd: list[str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def unique(prefix: str = "t") -> str:
    """A topic or client id no other test uses (tests share nothing, but logs stay readable)."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def uid() -> Callable[[str], str]:
    return unique


# --------------------------------------------------------------------------- MQTT 5 clients


@pytest.fixture
def v5(broker: BrokerHandle) -> Iterator[Callable[..., Any]]:
    """``make(client_id="") -> Paho5`` on the ``broker`` fixture (not yet connected);
    stopped at teardown."""
    from mqtt5_support import Paho5

    made: list[Paho5] = []

    def make(client_id: str = "") -> Paho5:
        client = Paho5(broker.host, broker.port, client_id)
        made.append(client)
        return client

    yield make
    for client in made:
        client.client.loop_stop()
        with contextlib.suppress(Exception):  # already gone
            client.client.disconnect()
