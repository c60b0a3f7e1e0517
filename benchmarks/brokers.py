"""Start, identify and stop the brokers under comparison.

Each broker runs as a subprocess we own, on a free loopback port, with a generated
configuration in a temporary directory; ``BrokerHandle.stop`` always runs (callers use it in
``finally``).  A broker that cannot be started is not an error of the suite: the handle's
``unavailable`` says why, and the report prints that instead of figures.

Configurations are as close to each broker's defaults as an honest comparison allows:
persistence off for mosquitto, amqtt without its packet/event logging plugins (they log every
packet), mqttring with ``$SYS`` publishing off and warnings-only logging.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
AMQTT_VENV = REPO / ".venv-amqtt"
AMQTT_VERSION = "0.12.1"


@dataclass
class BrokerHandle:
    name: str
    host: str = "127.0.0.1"
    port: int = 0
    pid: int | None = None
    version: str = "unknown"
    unavailable: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    tmpdir: str | None = None
    extra: dict[str, object] = field(default_factory=dict)

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def stop(self) -> None:
        """Terminate (then kill) our subprocess and remove its temporary directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    def stderr_tail(self) -> str:
        if not self.tmpdir:
            return ""
        path = Path(self.tmpdir) / "stderr.log"
        with contextlib.suppress(OSError):
            return path.read_text(errors="replace")[-1500:]
        return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(handle: BrokerHandle, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not handle.alive():
            return False
        with (
            contextlib.suppress(OSError),
            socket.create_connection((handle.host, handle.port), 0.5),
        ):
            return True
        time.sleep(0.05)
    return False


def _spawn(handle: BrokerHandle, argv: list[str], env: dict[str, str] | None = None) -> None:
    assert handle.tmpdir
    err = open(Path(handle.tmpdir) / "stderr.log", "wb")  # noqa: SIM115 - owned by the child
    handle.proc = subprocess.Popen(
        argv,
        stdout=err,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=handle.tmpdir,
    )
    err.close()
    handle.pid = handle.proc.pid


def _fail(handle: BrokerHandle, why: str) -> BrokerHandle:
    tail = handle.stderr_tail().strip()
    handle.stop()
    handle.unavailable = why + (f" (stderr: {tail[-400:]})" if tail else "")
    return handle


def start_mosquitto() -> BrokerHandle:
    h = BrokerHandle("mosquitto")
    exe = shutil.which("mosquitto") or (
        "/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else None
    )
    if exe is None:
        h.unavailable = "mosquitto not installed (apt-get install mosquitto)"
        return h
    out = subprocess.run([exe, "-h"], capture_output=True, text=True, timeout=5)
    m = re.search(r"mosquitto version (\S+)", out.stdout + out.stderr)
    h.version = m.group(1) if m else "unknown"
    h.tmpdir = tempfile.mkdtemp(prefix="bench-mosquitto-")
    h.port = free_port()
    conf = Path(h.tmpdir) / "mosquitto.conf"
    conf.write_text(
        f"listener {h.port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
        "log_dest stderr\nlog_type error\nlog_type warning\nmax_connections -1\n"
        # 2.0 drops QoS 1 messages for an ONLINE client past 1000 queued, and it reads a
        # subscriber's PUBACKs more slowly than 4 publishers' PUBLISHes, so its un-acked
        # queue passes 1000 even under our closed loop: lift the cap (documented).
        "max_queued_messages 1000000\n"
    )
    _spawn(h, [exe, "-c", str(conf)])
    if not wait_listening(h):
        return _fail(h, "mosquitto did not start listening")
    return h


def ensure_amqtt(log: bool = True) -> tuple[Path | None, str]:
    """amqtt lives in its own venv so its dependencies cannot disturb ours; create on first use."""
    exe = AMQTT_VENV / "bin" / "amqtt"
    if not exe.exists():
        if log:
            print(f"installing amqtt=={AMQTT_VERSION} into {AMQTT_VENV} (first use)", flush=True)
        try:
            subprocess.run([sys.executable, "-m", "venv", str(AMQTT_VENV)], check=True, timeout=120)
            subprocess.run(
                [str(AMQTT_VENV / "bin" / "pip"), "install", "--quiet", f"amqtt=={AMQTT_VERSION}"],
                check=True,
                timeout=600,
            )
        except (subprocess.SubprocessError, OSError) as exc:
            return None, f"could not install amqtt into {AMQTT_VENV}: {exc}"
    if not exe.exists():
        return None, f"{exe} missing after install"
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=30)
    return exe, (out.stdout.strip().split()[-1] if out.stdout.strip() else "unknown")


def start_amqtt() -> BrokerHandle:
    h = BrokerHandle("amqtt")
    exe, version = ensure_amqtt()
    if exe is None:
        h.unavailable = version
        return h
    h.version = version
    h.tmpdir = tempfile.mkdtemp(prefix="bench-amqtt-")
    h.port = free_port()
    conf = Path(h.tmpdir) / "amqtt.yaml"
    conf.write_text(
        "---\nlisteners:\n  default:\n    type: tcp\n"
        f"    bind: 127.0.0.1:{h.port}\n    max_connections: 0\n"
        "plugins:\n  amqtt.plugins.authentication.AnonymousAuthPlugin:\n    allow_anonymous: true\n"
    )
    _spawn(h, [str(exe), "-c", str(conf)])
    if not wait_listening(h, 30):
        return _fail(h, "amqtt did not start listening")
    return h


def mqttring_version() -> str:
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        return version("mqttring")
    return "unknown"


def start_mqttring() -> BrokerHandle:
    """``python -m mqttring.node`` with a ready file; no module or no ready file: unavailable."""
    h = BrokerHandle("mqttring", version=mqttring_version())
    if (
        importlib.util.find_spec("mqttring") is None
        or importlib.util.find_spec("mqttring.node") is None
    ):
        h.unavailable = "mqttring.node does not exist yet (src/mqttring/node.py missing)"
        return h
    h.tmpdir = tempfile.mkdtemp(prefix="bench-mqttring-")
    h.port = free_port()
    ready = Path(h.tmpdir) / "ready.json"
    _spawn(
        h,
        [
            sys.executable,
            "-m",
            "mqttring.node",
            "--mqtt",
            f"127.0.0.1:{h.port}",
            "--data-dir",
            str(Path(h.tmpdir) / "data"),
            "--sys-interval",
            "0",
            "--log-level",
            "warning",
            "--ready-file",
            str(ready),
        ],
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and h.alive():
        if ready.exists():
            with contextlib.suppress(ValueError, OSError):
                info = json.loads(ready.read_text())
                h.port = int(info.get("mqtt", h.port))
                # The node may run in a child of the process we started: trust its own pid.
                h.pid = int(info.get("pid", h.pid))
                if wait_listening(h, 5):
                    return h
        time.sleep(0.05)
    if not h.alive():
        return _fail(h, f"mqttring.node exited with code {h.proc.returncode if h.proc else '?'}")
    return _fail(h, "mqttring.node wrote no ready file within 30 s")


def attach_target(spec: str) -> BrokerHandle:
    """``[NAME=]HOST:PORT``: a broker someone else runs; its pid is looked up if it is local."""
    name, _, addr = spec.rpartition("=")
    host, _, port = addr.rpartition(":")
    h = BrokerHandle(name or f"target:{addr}", host=host or "127.0.0.1", port=int(port))
    h.pid = listening_pid(h.port)
    h.version = "external"
    if not wait_listening(h, 5):
        h.unavailable = f"nothing accepts connections on {addr}"
    return h


def listening_pid(port: int) -> int | None:
    """Pid of the local process listening on ``port``, read from /proc, or None.

    Not ``psutil.net_connections``: importing pysyncobj (which mqttring does) replaces
    ``socket.inet_ntop`` with a broken shim, and psutil's address decoding then raises.
    """
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return int(entry.name)
    return None


STARTERS = {"mqttring": start_mqttring, "mosquitto": start_mosquitto, "amqtt": start_amqtt}
