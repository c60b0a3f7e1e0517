"""A real mosquitto broker for differential tests: started with the given settings on a
free loopback port, killed (by its own handle) when the block ends."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from mqttring.raft.localcluster import free_port


@contextlib.contextmanager
def mosquitto(tmp_path: Path, settings: str) -> Iterator[int]:
    """mosquitto with ``settings`` (mosquitto.conf lines, the listener added); its port."""
    port = free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\n{settings}"
                    + ("user root\n" if os.geteuid() == 0 else ""))
    broker = subprocess.Popen(["mosquitto", "-c", str(conf)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:  # bounded: until mosquitto listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert broker.poll() is None and time.monotonic() < deadline, "no mosquitto"
                time.sleep(0.05)
        yield port
    finally:
        broker.kill()
        broker.wait(10)
