"""The fault suite's short variant in the default test run: 3 real nodes in network
namespaces, kill -9 of a follower and isolation of a node, with shortened fault windows.

It runs the same harness as ``make faults`` (``python -m tests.faults.run``) in a child
process, because the harness re-executes itself inside the client namespace and must own
the namespaces' whole life.  The test fails when any contract check fails (the report's
failures are the message); it is skipped only when network namespaces cannot be created
here (not root, or no ``ip netns``/``nft``), which is decided by creating a throwaway one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .netns import can_create_namespaces

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(280)


def test_short_fault_suite(tmp_path: Path) -> None:
    ok, why = can_create_namespaces()
    if not ok:
        pytest.skip(f"fault suite needs network namespaces: {why}")
    out = tmp_path / "faults"
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / "harness.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.run", "--nodes", "3",
             "--scenario", "kill-follower,isolate", "--short", "--out", str(out)],
            cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(240)
        except subprocess.TimeoutExpired:
            # SIGTERM first: the harness then stops its nodes and deletes its namespaces
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            pytest.fail(f"fault suite exceeded 240 s:\n{log.read_text()[-3000:]}")
    report = out / "report.json"
    assert report.exists(), f"the harness wrote no report (rc {rc}):\n" \
        f"{log.read_text()[-3000:]}"
    summary = json.loads(report.read_text())
    harness = [e for r in summary["runs"] for e in r["harness_errors"]]
    assert not harness, f"harness errors (not the broker's): {harness}"
    failures = [f"{r['scenario']}: {f}" for r in summary["runs"] for f in r["failures"]]
    assert not failures, "cluster contract violated:\n" + "\n".join(failures) + \
        f"\n(full report: {report})"
