"""A stop signal at any moment of the start of ``python -m mqttring.raft.member`` and of
``python -m mqttring.devcluster`` is a clean stop (``mqttring.stop_signals``), as it is for
``python -m mqttring.node`` (``test_node_lifecycle``).

Both only had trio's signal receiver, opened once their start was done: a SIGINT while
they imported or joined was a traceback (status 1 or 130), a SIGTERM killed them (status
-15), and the dev cluster then left the nodes it had started running (they are in their
own session).  ``PYTHONPROFILEIMPORTTIME`` makes the interpreter write a line as each module
is imported: the signal is sent right after a given one, or at a later moment of the start
(a log line, a file).  Every wait is bounded and on a condition.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mqttring.raft.localcluster import free_base_port, free_port

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
STOP_BOUND = 30.0  # a signal -> the process has exited (generous for a loaded runner)


class Proc:
    """One process started with ``PYTHONPROFILEIMPORTTIME``; its output goes to a file."""

    def __init__(self, out: Path, *args: str) -> None:
        self.out = out
        with out.open("ab") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, *args], stdout=sink, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_for(self, what: str, done: Callable[[], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert self.proc.poll() is None, f"exited ({self.proc.returncode}) before " \
                                             f"{what}:\n{self.text()}"
            assert time.monotonic() < deadline, f"no {what} in {timeout}s:\n{self.text()}"
            time.sleep(0.02)

    def wait_line(self, needle: str) -> None:
        self.wait_for(repr(needle), lambda: needle in self.text())

    def signal_and_wait(self, signum: int) -> int:
        self.proc.send_signal(signum)
        try:
            return self.proc.wait(STOP_BOUND)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"ignored {signal.Signals(signum).name} for {STOP_BOUND}s:"
                                 f"\n{self.text()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.kill()


def _pids_running_under(directory: Path) -> list[int]:
    """Our processes whose command line names ``directory`` (the dev cluster's nodes)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            cmdline = (entry / "cmdline").read_bytes()
            if (entry / "stat").read_text().rpartition(") ")[2].startswith("Z"):
                continue  # a zombie: exited already
        except OSError:
            continue
        if str(directory).encode() in cmdline:
            found.append(int(entry.name))
    return found


@pytest.mark.parametrize(("when", "signum"), [
    ("trio._core._run", signal.SIGTERM),
    ("mqttring.raft.service", signal.SIGINT),
    ("joining", signal.SIGTERM),
    ("joining", signal.SIGINT),
    ("member", signal.SIGTERM),
], ids=["imports-SIGTERM", "late-imports-SIGINT", "joining-SIGTERM", "joining-SIGINT",
        "member-SIGTERM"])
def test_a_signal_at_any_moment_of_a_members_start_is_a_clean_stop(tmp_path, procs, when,
                                                                    signum):
    """``joining``: ``--join`` to an address nobody listens on, signalled while it asks;
    ``member``: a one-member cluster, signalled once its ready file is written (the leave
    path, which worked before: the control case)."""
    ready = tmp_path / "ready.json"
    args = ["-m", "mqttring.raft.member", "--node-id", "m1", "--cluster",
            f"{HOST}:{free_port()}", "--raft", f"{HOST}:{free_port()}", "--data-dir",
            str(tmp_path / "data"), "--secret", "s3cret", "--ready-file", str(ready)]
    nobody = free_port()
    if when == "joining":
        args += ["--join", f"{HOST}:{nobody}"]
    member = Proc(tmp_path / "member.out", *args)
    procs.append(member)
    if when == "joining":
        member.wait_line(f"via {HOST}:{nobody} failed")
    elif when == "member":
        member.wait_for("ready file", ready.exists)
    else:
        member.wait_line(when)
    assert member.signal_and_wait(signum) == 0, member.text()
    text = member.text()
    assert "Traceback" not in text, text
    if when in ("joining", "member"):  # logging is set up by then
        name = signal.Signals(signum).name
        expected = "leaving the cluster" if when == "member" else "stopping (starting)"
        assert f"signal {name}: {expected}" in text, text


@pytest.mark.parametrize(("when", "signum"), [
    ("trio._core._run", signal.SIGTERM),
    ("mqttring.certs", signal.SIGINT),
    ("node1 starting", signal.SIGTERM),
    ("node2 starting", signal.SIGHUP),
    ("node2 starting", signal.SIGINT),
], ids=["imports-SIGTERM", "certs-SIGINT", "first-node-SIGTERM", "second-node-SIGHUP",
        "second-node-SIGINT"])
def test_a_signal_at_any_moment_of_a_dev_clusters_start_stops_every_node(tmp_path, procs,
                                                                          when, signum):
    """``nodeN starting``: signalled once that node's log has its first line (the node is
    up to its store, Raft or join).  The dev cluster exits 0 without a traceback, and no
    node it started is left running."""
    data_dir = tmp_path / "dev"
    base = free_base_port()
    dev = Proc(tmp_path / "dev.out", "-m", "mqttring.devcluster", "--nodes", "2",
               "--data-dir", str(data_dir), "--base-port", str(base))
    procs.append(dev)
    try:
        if when.endswith(" starting"):
            log = data_dir / f"{when.split()[0]}.log"
            dev.wait_for(f"a line in {log.name}",
                         lambda: log.exists() and log.stat().st_size > 0)
        else:
            dev.wait_line(when)
        assert dev.signal_and_wait(signum) == 0, dev.text()
        assert "Traceback" not in dev.text(), dev.text()
        assert _pids_running_under(data_dir) == [], "a node outlived the dev cluster"
    finally:
        for pid in _pids_running_under(data_dir):
            os.kill(pid, signal.SIGKILL)
    if when.endswith(" starting"):
        assert "stopping the cluster" in dev.text(), dev.text()
        for ready in data_dir.glob("*.ready"):
            json.loads(ready.read_text())  # a node that was ready wrote a whole file
