"""``python -m mqttring.node --workers N`` (``mqttring.workers``): N real node processes on
one machine, one cluster, one MQTT port (SO_REUSEPORT), stopped and started as one.

Which worker serves a connection is read from the kernel (``ss -tnp``: the process that
owns the accepted socket), not from anything the broker says about itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from mqtt_client import CONNACK, PUBLISH, RawClient, connect, puback, publish

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"


class Workers:
    """One supervisor process; its ready file says where it listens and who its workers are."""

    def __init__(self, data_dir: Path, count: int, log_path: Path) -> None:
        self.data_dir = data_dir
        self.count = count
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict = {}

    @property
    def ready_path(self) -> Path:
        return self.data_dir.parent / "ready.json"

    def launch(self, *flags: str) -> subprocess.Popen[bytes]:
        """Start the supervisor (in its own process group, for ``kill_all``); not waiting."""
        self.ready_path.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "mqttring.node", "--workers", str(self.count),
               "--mqtt", f"{HOST}:0", "--data-dir", str(self.data_dir),
               "--sys-interval", "0", "--ready-file", str(self.ready_path), *flags]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        return self.proc

    def wait_ready(self, timeout: float = 60.0) -> dict:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (
                f"supervisor exited with {self.proc.returncode}:\n{self.log()}")
            try:
                self.info = json.loads(self.ready_path.read_text())
                return self.info
            except (FileNotFoundError, json.JSONDecodeError):
                time.sleep(0.05)
        raise AssertionError(f"workers not ready in {timeout}s:\n{self.log()}")

    def start(self, timeout: float = 60.0, *flags: str) -> dict:
        self.launch(*flags)
        return self.wait_ready(timeout)

    @property
    def port(self) -> int:
        return int(self.info["mqtt"])

    def worker_pids(self) -> set[int]:
        return {int(w["pid"]) for w in self.info["workers"]}

    def stop(self, timeout: float = 40.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill_all(self) -> None:
        """The supervisor and whatever is left of its workers (they share its group, also
        when a failed test left them orphaned)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    w = Workers(tmp_path / "data", 2, tmp_path / "workers.log")
    yield w
    w.kill_all()


def serving_pids(port: int) -> list[int]:
    """Pids of the processes holding the accepted (server-side) sockets of ``port``."""
    out = subprocess.run(["ss", "-Htnp", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True, check=True).stdout
    return [int(pid) for pid in re.findall(r"pid=(\d+)", out)]


def test_workers_share_one_port_and_behave_as_one_broker(workers: Workers) -> None:
    workers.start()
    pids = workers.worker_pids()
    assert len(pids) == 2
    clients = [RawClient(HOST, workers.port) for _ in range(16)]
    try:
        for n, client in enumerate(clients):
            assert client.connect(f"w-client-{n}").return_code == 0
        serving = serving_pids(workers.port)
        assert len(serving) == 16 and set(serving) == pids, (
            f"16 connections should be spread over both workers {pids}: {serving}")
        # Pair each client with the worker serving it by the client's own port.
        local = {c.sock.getsockname()[1]: c for c in clients}
        out = subprocess.run(["ss", "-Htnp", "state", "established",
                              f"( sport = :{workers.port} )"],
                             capture_output=True, text=True, check=True).stdout
        by_pid: dict[int, list[RawClient]] = {pid: [] for pid in pids}
        for line in out.splitlines():
            peer_port = int(line.split()[3].rsplit(":", 1)[1])
            found = re.search(r"pid=(\d+)", line)
            assert found is not None, line
            pid = int(found.group(1))
            by_pid[pid].append(local[peer_port])
        first, second = (by_pid[pid][0] for pid in sorted(pids))
        assert first.subscribe([("w/t", 1)]) == [1]
        second.send(publish("w/t", b"across workers", qos=1, packet_id=1))
        got = first.recv_packet()
        assert (got.type, got.payload) == (PUBLISH, b"across workers")
        first.send(puback(got.packet_id))
    finally:
        for client in clients:
            client.close()


def test_a_stopped_set_of_workers_comes_back_with_its_data(workers: Workers) -> None:
    workers.start()
    port = workers.port
    session = RawClient(HOST, port)
    assert session.connect("w-persistent", clean_session=False).return_code == 0
    assert session.subscribe([("w/queued", 1)]) == [1]
    session.close()
    pub = RawClient(HOST, port)
    assert pub.connect("w-pub").return_code == 0
    pub.send(publish("w/kept", b"retained", qos=1, retain=True, packet_id=1))
    pub.send(publish("w/queued", b"while away", qos=1, packet_id=2))
    assert [pub.recv_packet().packet_id for _ in range(2)] == [1, 2]
    pub.close()

    started = time.monotonic()
    assert workers.stop() == 0, workers.log()
    assert time.monotonic() - started < 30
    assert workers.start()["mqtt"] == port, "the port picked for :0 is kept"
    # Every port it picked lies below the kernel's ephemeral range: an outgoing connection
    # (or its TIME_WAIT) on a saved port made a later start fail "address in use".
    saved = json.loads((workers.data_dir / "workers.json").read_text())
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picked = [saved["mqtt_port"]] + [int(w[kind].rsplit(":", 1)[1])
                                     for w in saved["workers"] for kind in ("cluster", "raft")]
    assert all(p < low for p in picked) and len(set(picked)) == len(picked), picked

    late = RawClient(HOST, port)
    assert late.connect("w-late").return_code == 0
    late.subscribe([("w/kept", 1)])
    got = late.recv_packet()
    assert (got.payload, got.retain) == (b"retained", True)
    back = RawClient(HOST, port)
    back.send(connect("w-persistent", clean_session=False))
    ack = back.expect(CONNACK)
    assert (ack.return_code, ack.session_present) == (0, True)
    queued = back.recv_packet()
    assert (queued.topic, queued.payload) == ("w/queued", b"while away")
    for client in (late, back):
        client.close()


def test_another_worker_count_on_the_same_data_is_refused(workers: Workers,
                                                         tmp_path: Path) -> None:
    workers.start()
    assert workers.stop() == 0
    other = subprocess.run(
        [sys.executable, "-m", "mqttring.node", "--workers", "3", "--mqtt", f"{HOST}:0",
         "--data-dir", str(workers.data_dir)], capture_output=True, text=True, timeout=30)
    assert other.returncode == 2
    assert "holds a cluster of 2 workers, not 3" in other.stderr
    assert "Traceback" not in other.stderr


def test_an_http_api_with_workers_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """Every worker would bind the one HTTP port: the second failed and the supervisor gave
    up after starting them all (a probe).  Refused at once, as a configuration error."""
    out = subprocess.run(
        [sys.executable, "-m", "mqttring.node", "--workers", "2", "--mqtt", f"{HOST}:0",
         "--http", f"{HOST}:0", "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "not with --workers" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "data").exists()


def test_paho_and_mosquitto_clients_see_one_broker(workers: Workers) -> None:
    """Real clients on ``--workers 2``: four paho publishers (spread over both workers by
    the kernel) with 50 QoS 1 and QoS 2 messages each in flight at once; a mosquitto_sub
    gets every message once, in each publisher's order per QoS, whichever worker took it, and a
    retained message set with mosquitto_pub is there for a paho subscriber."""
    import paho.mqtt.client as mqtt

    from cluster_support import MosquittoSub, mosquitto_pub

    workers.start()
    port = workers.port
    mosquitto_pub(port, "wp/probe", "probe", qos=1, retain=True)
    sub = MosquittoSub(port, ["wp/#"], qos=2, timeout=60)
    publishers: list[mqtt.Client] = []
    try:
        assert sub.line() == "wp/probe 1 1 probe"  # subscribed (retained probe first)
        # Four publishers, more while the kernel put every connection on one worker.
        while len(publishers) < 4 or len(set(serving_pids(port))) < 2:
            assert len(publishers) < 32, "the kernel never spread the clients over both"
            client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                                 client_id=f"wp-pub-{len(publishers)}", protocol=mqtt.MQTTv311)
            client.max_inflight_messages_set(100)
            client.connect(HOST, port)
            client.loop_start()
            publishers.append(client)
            while len(serving_pids(port)) < len(publishers) + 1:  # its CONNECT is accepted
                time.sleep(0.01)
        infos = [client.publish(f"wp/{n}", f"{n}-{i}", qos=1 + i % 2)
                 for n, client in enumerate(publishers) for i in range(50)]
        for info in infos:
            info.wait_for_publish(30)
            assert info.is_published()
        # Order is per topic *and QoS* [MQTT-4.6.0-7]; libmosquitto also hands a QoS 2
        # message to mosquitto_sub only at its PUBREL, after QoS 1 messages sent later.
        got: dict[tuple[str, int], list[int]] = {}
        for _ in range(len(publishers) * 50):
            topic, _qos, _retain, payload = sub.line(30).split(" ", 3)
            i = int(payload.split("-")[1])
            got.setdefault((topic, 1 + i % 2), []).append(i)
        assert got == {(f"wp/{n}", q): list(range(q - 1, 50, 2))
                       for n in range(len(publishers)) for q in (1, 2)}

        received: list[mqtt.MQTTMessage] = []
        reader = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="wp-reader",
                             protocol=mqtt.MQTTv311)
        reader.on_message = lambda c, u, m: received.append(m)
        reader.connect(HOST, port)
        reader.loop_start()
        try:
            reader.subscribe("wp/probe", 1)
            deadline = time.monotonic() + 10
            while not received and time.monotonic() < deadline:
                time.sleep(0.02)
            assert [(m.topic, m.payload, m.retain) for m in received] == [
                ("wp/probe", b"probe", True)]
        finally:
            reader.loop_stop()
            reader.disconnect()
    finally:
        for client in publishers:
            client.loop_stop()
            client.disconnect()
        sub.close()


def test_sighup_to_the_supervisor_reloads_every_worker(workers: Workers, tmp_path: Path
                                                      ) -> None:
    config = tmp_path / "node.toml"
    config.write_text("[limits]\nmax_inflight = 32\n")
    workers.start(60.0, "--config", str(config))
    config.write_text("[limits]\nmax_inflight = 64\n")
    assert workers.proc is not None
    workers.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while workers.log().count("reloaded: limits.max_inflight 32 -> 64") < 2:
        assert time.monotonic() < deadline, workers.log()
        assert workers.proc.poll() is None, workers.log()
        time.sleep(0.1)
    assert "SIGHUP: passing it on to 2 workers" in workers.log()
    assert workers.stop() == 0


# --- The supervisor's own life: signals at any stage, its death, a worker that keeps dying.


def wait_for(condition: Callable[[], object], timeout: float, what: str,
             log: Callable[[], str]) -> object:
    """``condition()``'s first true value, polled until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} within {timeout}s:\n{log()}"
        time.sleep(0.05)


def _stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name: [state, ppid, ...]; None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it has ended)."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def children(pid: int) -> dict[int, str]:
    """The live child processes of ``pid`` (its workers), each with its ``--node-id``."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _stat(int(entry.name))
        if stat is None or stat[1] != str(pid) or stat[0] in ("Z", "X"):
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError):
            continue
        node_id = args[args.index(b"--node-id") + 1].decode() if b"--node-id" in args else ""
        found[int(entry.name)] = node_id
    return found


def starting_workers(workers: Workers) -> set[int]:
    """Wait until the supervisor has started both workers; their pids (not ready yet)."""
    assert workers.proc is not None
    supervisor = workers.proc.pid

    def both() -> set[int] | None:
        assert workers.proc is not None and workers.proc.poll() is None, workers.log()
        pids = set(children(supervisor))
        return pids if len(pids) == 2 else None

    pids = wait_for(both, 30, "two workers started", workers.log)
    assert isinstance(pids, set)
    assert not workers.ready_path.exists(), "the workers were ready already: too slow to test"
    return pids


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_while_the_workers_start_stops_every_one(workers: Workers,
                                                               signum: signal.Signals) -> None:
    """Before the supervisor is ready it must already hold its signals: a SIGTERM with the
    default disposition killed it alone and left its workers serving the port as orphans,
    and a SIGINT was a KeyboardInterrupt traceback."""
    workers.launch()
    pids = starting_workers(workers)
    assert workers.proc is not None
    workers.proc.send_signal(signum)
    assert workers.proc.wait(40) == 0, workers.log()
    wait_for(lambda: not any(alive(pid) for pid in pids), 10, "no worker left", workers.log)
    log = workers.log()
    assert f"signal {signum.name}: stopping 2 workers (starting)" in log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log


def test_a_sighup_while_the_workers_start_is_passed_on_once_they_are_ready(
        workers: Workers) -> None:
    """SIGHUP while starting: the supervisor (and every worker) lives on, and each worker
    gets it once ready (a worker still importing would die of it)."""
    workers.launch()
    pids = starting_workers(workers)
    assert workers.proc is not None
    workers.proc.send_signal(signal.SIGHUP)
    workers.wait_ready()
    assert workers.worker_pids() == pids, "the workers started first are the ones serving"
    wait_for(lambda: workers.log().count("SIGHUP: no --config file, settings unchanged") == 2,
             20, "both workers handled the SIGHUP", workers.log)
    log = workers.log()
    assert "SIGHUP while the workers start: passing it on once they are ready" in log
    assert "SIGHUP: passing it on to 2 workers" in log
    assert "exited with" not in log, log
    assert workers.stop() == 0, workers.log()
    assert not any(alive(pid) for pid in pids)


def test_the_workers_stop_when_their_supervisor_is_killed(workers: Workers) -> None:
    """kill -9 of the supervisor: each worker sees its lifeline close and stops, so the
    port is free and the next start comes back on it (orphans made it 'address in use')."""
    workers.start()
    pids, port = workers.worker_pids(), workers.port
    assert workers.proc is not None
    workers.proc.kill()
    workers.proc.wait(10)
    wait_for(lambda: not any(alive(pid) for pid in pids), 15, "the workers stopped",
             workers.log)
    assert workers.log().count("the workers' supervisor is gone: stopping") == 2
    assert workers.start()["mqtt"] == port, workers.log()
    client = RawClient(HOST, port)
    try:
        assert client.connect("w-after-kill").return_code == 0
    finally:
        client.close()
    assert workers.stop() == 0, workers.log()


def test_a_worker_that_keeps_dying_stops_the_supervisor(workers: Workers) -> None:
    """Past the restart budget (5 a minute) the supervisor stops every worker and exits 1:
    the one left alone has no Raft majority and would refuse every client, while a living
    supervisor keeps a process manager from restarting the whole set."""
    from mqttring.workers import MAX_RESTARTS

    workers.start()
    assert workers.proc is not None
    supervisor = workers.proc.pid
    survivor = next(int(w["pid"]) for w in workers.info["workers"]
                    if w["node_id"].endswith("-w0"))
    victim = next(int(w["pid"]) for w in workers.info["workers"]
                  if w["node_id"].endswith("-w1"))

    def restarted(old: int) -> int | None:
        assert workers.proc is not None and workers.proc.poll() is None, workers.log()
        return next((pid for pid, node_id in children(supervisor).items()
                     if node_id.endswith("-w1") and pid != old), None)

    for kill in range(MAX_RESTARTS + 1):
        os.kill(victim, signal.SIGKILL)
        if kill == MAX_RESTARTS:
            break
        found = wait_for(partial(restarted, victim), 15, f"w1 started again ({kill + 1})",
                         workers.log)
        assert isinstance(found, int)
        victim = found
    assert workers.proc.wait(40) == 1, workers.log()
    assert not alive(survivor) and not alive(victim)
    log = workers.log()
    assert f"{MAX_RESTARTS} restarts within a minute, giving up: stopping every worker" in log
    assert f"exited {MAX_RESTARTS + 1} times within a minute" in log
    assert "Traceback" not in log
