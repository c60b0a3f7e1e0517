"""MQTT.js (the `mqtt` npm package, pinned in ``tests/js/package-lock.json``) as a test client.

``ensure_mqttjs()`` installs the pinned packages with ``npm ci`` when
``tests/js/node_modules`` lacks them, once, under an exclusive file lock so that parallel
pytest processes (xdist workers, two worktrees' runs) never install over each other.
``run_exchange(spec)`` runs ``tests/js/exchange.js`` (see its header for the spec) as a
process with a hard timeout, kills it past that, and returns the one JSON line it printed.

A missing ``node`` or ``npm`` is a failure, not a skip: the suite promises that MQTT.js
talks to mqttring, and ``.ci/run`` installs both.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

JS_DIR = Path(__file__).parent / "js"
_installed = False


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not installed: the MQTT.js tests need Node.js and npm "
                    "(apt-get install nodejs npm; .ci/run does it)", pytrace=False)
    return path


def _complete() -> bool:
    """The pinned mqtt package is there (a half-done install lacks its package.json or
    has another version, and is redone)."""
    lock = json.loads((JS_DIR / "package-lock.json").read_text())
    want = lock["packages"]["node_modules/mqtt"]["version"]
    try:
        have = json.loads((JS_DIR / "node_modules" / "mqtt" / "package.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return have.get("version") == want


def ensure_mqttjs() -> str:
    """Install tests/js's packages if needed; returns the path of ``node``."""
    global _installed
    node = _tool("node")
    if _installed:
        return node
    with open(JS_DIR / ".install.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file closes
        if not _complete():
            npm = _tool("npm")
            done = subprocess.run(
                [npm, "ci", "--prefix", str(JS_DIR), "--no-audit", "--no-fund"],
                capture_output=True, text=True, timeout=300, check=False)
            if done.returncode != 0 or not _complete():
                pytest.fail(f"npm ci in {JS_DIR} failed ({done.returncode}):\n"
                            f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}", pytrace=False)
    _installed = True
    return node


def run_exchange(spec: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """Run exchange.js with ``spec``; the script's own timeout is ``spec['timeout_ms']``,
    ours (``timeout``, a few seconds more) kills it if it hangs anyway. Fails the test on a
    non-zero exit, with what the script reported."""
    node = ensure_mqttjs()
    proc = subprocess.Popen([node, str(JS_DIR / "exchange.js"), json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            out, err = proc.communicate(timeout=5)
        raise AssertionError(f"exchange.js still running after {timeout}s: killed") from None
    lines = [line for line in out.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else None
    assert proc.returncode == 0 and result is not None and result["ok"], (
        f"exchange.js exited {proc.returncode}: {result!r}\nstderr: {err[-3000:]}")
    return result
