"""What a view change costs the event loop of the nodes already in the cluster.

Reproduces the stall audit of 2026-11-29 (``docs/design.md``, critique: "What a view change
costs"): a 2-node cluster (``a``, ``b``) holds N retained messages and M persistent offline
sessions with K subscriptions each; a third node ``c`` joins, then leaves
(``mqttring leave``).  A probe client on each of ``a`` and ``b`` publishes QoS 0 to itself
200 times a second; the longest gap between two of its messages while the view changes is
the longest the node's loop (or the owner's it goes through) did nothing else.  Each node
also runs with a trio instrument that logs its task steps longer than 20 ms, and its
garbage collections longer than 20 ms: the longest per phase and node, with its task's name
and where it waits next (``*_loop``), is the loop's own account.  It also
counts how often ``a`` and ``b`` fenced themselves (their log's "fencing:" lines): a loop
blocked past ``fence_seconds`` makes a node fence itself because of its own view change.

    python -m benchmarks.bench_view_change [--retained N] [--sessions M] [--subs K]
        [--src DIR]   # the mqttring sources to run (a worktree's ``src``: before/after)

Prints one JSON object.  Small defaults (20k retained, 2k sessions x 5) run in 1-2 minutes
on 2 cores; the audit's figures were taken with 100k retained and 10k sessions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SECRET = "bench-view-change-secret-0123456789abcdef"


# -- raw MQTT 3.1.1 (no dependency on the code under test) ---------------------------------

def _remaining(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _string(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return struct.pack("!H", len(raw)) + raw


def connect_packet(client_id: str, clean: bool = True) -> bytes:
    body = _string("MQTT") + bytes([4, 0x02 if clean else 0]) + struct.pack("!H", 60)
    body += _string(client_id)
    return b"\x10" + _remaining(len(body)) + body


def publish_packet(topic: str, payload: bytes, retain: bool = False) -> bytes:
    body = _string(topic) + payload
    return bytes([0x30 | (1 if retain else 0)]) + _remaining(len(body)) + body


def subscribe_packet(pid: int, filters: list[tuple[str, int]]) -> bytes:
    body = struct.pack("!H", pid) + b"".join(_string(f) + bytes([q]) for f, q in filters)
    return b"\x82" + _remaining(len(body)) + body


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return bytes(buf)


def read_packet(sock: socket.socket) -> tuple[int, bytes]:
    header = _exact(sock, 1)[0]
    multiplier = length = 0
    multiplier = 1
    while True:
        byte = _exact(sock, 1)[0]
        length += (byte & 0x7F) * multiplier
        multiplier *= 128
        if not byte & 0x80:
            return header, _exact(sock, length)


def connect(port: int, client_id: str, clean: bool = True) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(connect_packet(client_id, clean))
    header, body = read_packet(sock)
    if header >> 4 != 2 or body[1] != 0:
        raise RuntimeError(f"CONNECT to {port} refused: {body!r}")
    return sock


# -- the nodes ----------------------------------------------------------------------------

#: Runs a node with a trio instrument that logs every task step longer than 20 ms (its
#: task's name): the loop's own account of what blocked it, beside the probes' gaps.
NODE_WITH_STEPS = """
import gc, sys, time, trio
from mqttring import node

class Steps(trio.abc.Instrument):
    started = 0.0
    def before_task_step(self, task):
        self.started = time.perf_counter()
    def after_task_step(self, task):
        took = time.perf_counter() - self.started
        if took > 0.02:
            print(f"SLOWSTEP {took * 1000:.0f} {task.name} @ {where(task)}", file=sys.stderr,
                  flush=True)

def where(task):
    # Where the task waits now: the await the slow step ended at.
    coro, place = task.coro, "?"
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        if "mqttring" in frame.f_code.co_filename:
            place = f"{frame.f_code.co_qualname}:{frame.f_lineno}"
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return place

collecting = [0.0]

def on_gc(phase, info):
    if phase == "start":
        collecting[0] = time.perf_counter()
        return
    took = time.perf_counter() - collecting[0]
    if took > 0.02:
        print(f"SLOWGC {took * 1000:.0f} generation {info['generation']}", file=sys.stderr,
              flush=True)

gc.callbacks.append(on_gc)
run = trio.run
trio.run = lambda *args, **kwargs: run(*args, instruments=[Steps()], **kwargs)
sys.exit(node.main(sys.argv[1:]))
"""

class Node:
    def __init__(self, name: str, base: int, root: Path, src: str) -> None:
        self.name, self.mqtt, self.cluster = name, base, base + 1
        self.dir = root / name
        self.dir.mkdir(parents=True)
        self.log = self.dir / "log"
        self.src = src
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, join: Node | None = None) -> None:
        b = self.mqtt
        cmd = [sys.executable, "-c", NODE_WITH_STEPS, "--node-id", self.name,
               "--mqtt", f"127.0.0.1:{b}", "--cluster", f"127.0.0.1:{b + 1}",
               "--raft", f"127.0.0.1:{b + 2}", "--data-dir", str(self.dir / "data"),
               "--ready-file", str(self.dir / "ready"), "--log-level", "info"]
        if join is not None:
            cmd += ["--join", f"127.0.0.1:{join.cluster}"]
        env = dict(os.environ, MQTTRING_CLUSTER_SECRET=SECRET, PYTHONPATH=self.src)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 60
        while not (self.dir / "ready").exists():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"node {self.name} did not start; see {self.log}")
            time.sleep(0.1)

    def mark(self) -> int:
        return self.log.stat().st_size

    def slow_steps(self, since: int) -> dict[str, Any]:
        """The longest loop steps logged since ``mark`` returned ``since``."""
        with open(self.log, "rb") as log:
            log.seek(since)
            text = log.read().decode(errors="replace")
        steps, collections = [], []
        for line in text.splitlines():
            if line.startswith("SLOWSTEP "):
                _, ms, task = line.split(" ", 2)
                steps.append((int(ms), task))
            elif line.startswith("SLOWGC "):
                collections.append(int(line.split()[1]))
        steps.sort(reverse=True)
        return {"max_step_ms": steps[0][0] if steps else 0,
                "steps_over_50ms": sum(1 for ms, _ in steps if ms > 50),
                "longest": [f"{ms} ms {task}" for ms, task in steps[:3]],
                # Garbage collections over 20 ms (they fall in whichever step allocates).
                "gc_over_20ms": sorted(collections, reverse=True)[:5]}

    def fences(self) -> int:
        return self.log.read_text(errors="replace").count("; fencing:")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def settled(node: Node, members: int, timeout: float = 120.0) -> float:
    """Wait until ``node``'s view has ``members`` members, all up, no shard catching up;
    returns the seconds waited."""
    env = dict(os.environ, MQTTRING_CLUSTER_SECRET=SECRET, PYTHONPATH=node.src)
    started = time.time()
    while time.time() - started < timeout:
        out = subprocess.run([sys.executable, "-m", "mqttring", "status", "--json", "--node",
                              f"127.0.0.1:{node.cluster}"], env=env, capture_output=True,
                             text=True, check=False, timeout=60)
        if out.returncode == 0:
            view = json.loads(out.stdout)["view"]
            states = [m["state"] for m in view["members"].values()]
            catching = sum(c["catching_up"] for c in view["shard_counts"].values())
            if len(states) == members and set(states) == {"up"} and not catching:
                return time.time() - started
        time.sleep(1.0)
    raise RuntimeError(f"the view of {node.name} did not settle in {timeout} s")


def leave(node: Node) -> None:
    env = dict(os.environ, MQTTRING_CLUSTER_SECRET=SECRET, PYTHONPATH=node.src)
    subprocess.run([sys.executable, "-m", "mqttring", "leave", "--node",
                    f"127.0.0.1:{node.cluster}"], env=env, check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)


# -- load and probe -----------------------------------------------------------------------

def load_retained(port: int, n: int) -> None:
    sock = connect(port, "bench-retained-loader")
    buf = bytearray()
    for i in range(n):
        buf += publish_packet(f"r/{i % 100}/{i}", b"v" * 64, retain=True)
        if len(buf) > 64000:
            sock.sendall(buf)
            buf.clear()
            time.sleep(0.005)
    sock.sendall(bytes(buf) + b"\xc0\x00")  # PINGREQ: answered once the publishes are read
    while read_packet(sock)[0] >> 4 != 13:
        pass
    sock.sendall(b"\xe0\x00")
    sock.close()


def load_sessions(port: int, m: int, k: int) -> None:
    def one(i: int) -> None:
        sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        sock.sendall(connect_packet(f"sess-{i:06d}", clean=False)
                     + subscribe_packet(1, [(f"dev/{i}/f{j}", 1) for j in range(k)]))
        assert read_packet(sock)[0] >> 4 == 2
        assert read_packet(sock)[0] >> 4 == 9
        sock.sendall(b"\xe0\x00")
        sock.close()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(m)))


class Probe:
    """QoS 0 to itself at ``rate``/s; the longest gap between arrivals since ``reset``."""

    def __init__(self, port: int, name: str, rate: int = 200) -> None:
        self.port, self.name, self.rate = port, name, rate
        self.topic = f"probe/{name}"
        self.worst_gap = 0.0
        self.worst_latency = 0.0
        self.gaps_over_50ms = 0
        self.disconnects = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def reset(self) -> dict[str, Any]:
        with self.lock:
            figures = {"max_gap_ms": round(self.worst_gap * 1000),
                       "max_latency_ms": round(self.worst_latency * 1000),
                       "gaps_over_50ms": self.gaps_over_50ms,
                       "disconnects": self.disconnects}
            self.worst_gap = self.worst_latency = 0.0
            self.gaps_over_50ms = self.disconnects = 0
        return figures

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self._session()
            except (OSError, EOFError, RuntimeError, AssertionError):
                with self.lock:
                    self.disconnects += 1
                time.sleep(0.2)

    def _session(self) -> None:
        sock = connect(self.port, f"bench-probe-{self.name}-{time.time_ns() % 10**6}")
        sock.sendall(subscribe_packet(1, [(self.topic, 0)]))
        while read_packet(sock)[0] >> 4 != 9:
            pass
        sock.settimeout(None)
        last = [time.time()]
        broken = threading.Event()

        def receive() -> None:
            try:
                while True:
                    header, body = read_packet(sock)
                    if header >> 4 != 3:
                        continue
                    (length,) = struct.unpack("!H", body[:2])
                    (sent,) = struct.unpack("!d", body[2 + length:10 + length])
                    now = time.time()
                    with self.lock:
                        gap, last[0] = now - last[0], now
                        self.worst_gap = max(self.worst_gap, gap)
                        self.worst_latency = max(self.worst_latency, now - sent)
                        if gap > 0.05:
                            self.gaps_over_50ms += 1
            except (OSError, EOFError):
                broken.set()

        threading.Thread(target=receive, daemon=True).start()
        start, i = time.time(), 0
        try:
            while not self.stop.is_set() and not broken.is_set():
                i += 1
                delay = start + i / self.rate - time.time()
                if delay > 0:
                    time.sleep(delay)
                sock.sendall(publish_packet(self.topic, struct.pack("!d", time.time())))
        finally:
            sock.close()
        if broken.is_set():
            raise EOFError("probe connection lost")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the nodes bind
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_base() -> int:
    """A base port whose nodes' ports (three per node, 10 apart) are all free now: others
    share 43000-43999, and it lies within the range of ephemeral client ports."""
    import random

    for attempt in range(600):
        base = random.randrange(43000, 43600, 10)
        if all(_free(base + 10 * node + i) for node in range(3) for i in range(3)):
            return base
        if attempt % 60 == 59:
            time.sleep(1)  # others' connections come and go
    raise RuntimeError("no free ports for 3 nodes in 43000-43629")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--retained", type=int, default=20_000)
    parser.add_argument("--sessions", type=int, default=2_000)
    parser.add_argument("--subs", type=int, default=5)
    parser.add_argument("--settle", type=float, default=8.0,
                        help="seconds watched once the view settled after the join, and "
                             "after the leave")
    parser.add_argument("--base-port", type=int, default=0,
                        help="first of the 3x3 ports, 10 apart (default: free ones in 43000-43629)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the nodes' directories (logs, stores)")
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-view-change-"))
    base = args.base_port or free_base()
    nodes = [Node(name, base + 10 * i, root, args.src)
             for i, name in enumerate("abc")]
    a, b, c = nodes
    # Client sockets take ephemeral ports, which include 43000-43999 here: hold c's until
    # it starts, or a loader's connection may take one.
    reserved = []
    for port in (c.mqtt, c.cluster, c.cluster + 1):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        reserved.append(sock)
    probes: list[Probe] = []
    result: dict[str, Any] = {"retained": args.retained, "sessions": args.sessions,
                              "subscriptions_each": args.subs, "src": args.src}
    try:
        a.start()
        b.start(join=a)
        settled(a, 2)
        started = time.time()
        load_retained(a.mqtt, args.retained)
        load_sessions(a.mqtt, args.sessions, args.subs)
        result["load_s"] = round(time.time() - started, 1)
        probes = [Probe(a.mqtt, "a"), Probe(b.mqtt, "b")]
        time.sleep(5)
        result["steady"] = {p.name: p.reset() for p in probes}
        fences = {n.name: n.fences() for n in (a, b)}
        marks = {n.name: n.mark() for n in (a, b)}
        for sock in reserved:
            sock.close()
        c.start(join=a)
        result["join_settled_s"] = round(settled(a, 3), 1)
        time.sleep(args.settle)
        result["join"] = {p.name: p.reset() for p in probes}
        result["join_loop"] = {n.name: n.slow_steps(marks[n.name]) for n in (a, b)}
        marks = {n.name: n.mark() for n in (a, b)}
        leave(c)
        assert c.proc is not None
        try:
            c.proc.wait(90)
        except subprocess.TimeoutExpired:
            result["leave_error"] = "c did not exit within 90 s of its leave"
        result["leave_settled_s"] = round(settled(a, 2), 1)
        time.sleep(args.settle)
        result["leave"] = {p.name: p.reset() for p in probes}
        result["leave_loop"] = {n.name: n.slow_steps(marks[n.name]) for n in (a, b)}
        result["fences"] = {n.name: n.fences() - fences[n.name] for n in (a, b)}
        result["max_gap_ms"] = max(result[phase][p]["max_gap_ms"]
                                   for phase in ("join", "leave") for p in ("a", "b"))
        result["max_step_ms"] = max(result[phase][p]["max_step_ms"]
                                    for phase in ("join_loop", "leave_loop") for p in ("a", "b"))
    finally:
        for probe in probes:
            probe.stop.set()
        for node in reversed(nodes):
            node.stop()
        if args.keep:
            result["logs"] = str(root)
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
