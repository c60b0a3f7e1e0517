"""Helpers of the HTTP API tests: node processes with ``--http``, an HTTP client, metrics.

Nodes are real ``python -m mqttring.node`` processes; the ready file names the bound HTTP
port.  Requests go over real HTTP with httpx.  Every wait is bounded and polls a condition
(never a bare sleep), so the tests hold under a loaded runner.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

HOST = "127.0.0.1"
TOKEN = "test-token-0123456789abcdef"
T = TypeVar("T")
_OWN = object()


class HttpNode:
    """One node process with the HTTP listener on; ``stop()`` SIGTERMs it (by its pid)."""

    def __init__(self, root: Path, node_id: str = "h1", token: str | None = TOKEN,
                 extra: tuple[str, ...] = ()) -> None:
        self.root, self.node_id, self.token = root, node_id, token
        self.data_dir = root / f"{node_id}-data"
        self.ready = root / f"{node_id}.ready"
        self.log = root / f"{node_id}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("MQTTRING_HTTP_TOKEN", None)
        if token is not None:
            env["MQTTRING_HTTP_TOKEN"] = token
        cmd = [sys.executable, "-m", "mqttring.node", "--node-id", node_id,
               "--mqtt", f"{HOST}:0", "--http", f"{HOST}:0", "--data-dir", str(self.data_dir),
               "--sys-interval", "0", "--ready-file", str(self.ready), *extra]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        info = wait_for(self._read_ready, 30.0, f"{node_id} ready file")
        self.port, self.http_port = int(info["mqtt"]), int(info["http"])
        self.host, self.ws_port = HOST, None  # what the paho helpers read

    def _read_ready(self) -> dict[str, Any] | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.node_id} exited early:\n{self.log.read_text()}")
        try:
            return json.loads(self.ready.read_text())  # type: ignore[no-any-return]
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def http(self, token: str | object | None = _OWN) -> httpx.Client:
        """An HTTP client with this node's token (``token=`` another, or None: no header)."""
        token = self.token if token is _OWN else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=f"http://{HOST}:{self.http_port}", headers=headers,
                            timeout=15.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def wait_for(probe: Callable[[], T | None], timeout: float, what: str) -> T:
    """Poll ``probe`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.25)


def scrape(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` parsed by prometheus_client: (sample name, labels) -> value."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples
