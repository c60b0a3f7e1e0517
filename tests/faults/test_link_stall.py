"""A data link stuck in TCP's retransmission backoff is replaced and replayed: nothing sent
on it is lost, nothing is applied twice, order holds (``cluster/replay.py``).

The scenario (``link_stall.py``) runs in a network namespace of its own so that its
nftables rule, which cuts the link's established connection on loopback, touches nothing
else; skipped, like the fault suite, only where namespaces cannot be created.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .netns import IP, PREFIX, can_create_namespaces, delete_namespace

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("cut", ["both", "acks"])
def test_a_stalled_link_is_replaced_and_its_frames_replayed(cut: str) -> None:
    """``both``: TCP retransmits into a black hole.  ``acks``: a's bytes all arrive, b's
    acknowledgements never do, and a's TCP has nothing to retransmit (a sick node's links
    waited 8 s like that for a sample to catch TCP retransmitting)."""
    ok, why = can_create_namespaces()
    if not ok:
        pytest.skip(f"needs network namespaces: {why}")
    ns = f"{PREFIX}{os.getpid()}s{cut[0]}"
    subprocess.run([IP, "netns", "add", ns], check=True, timeout=20)
    try:
        subprocess.run([IP, "-n", ns, "link", "set", "lo", "up"], check=True, timeout=20)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
        run = subprocess.run([IP, "netns", "exec", ns, sys.executable, "-m",
                              "tests.faults.link_stall", cut], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
    finally:
        delete_namespace(ns)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["replaced"] >= 1, f"the stalled connection was never replaced: {result}"
    assert result["old_port"] not in result["new_ports"], result
    assert result["received"] == result["expected"], f"messages lost: {result}"
    assert result["unacked"] == 0, f"the sender never heard its frames were applied: {result}"
    assert result["distinct"] == result["received"] and result["in_order"], (
        f"messages applied twice or out of order: {result}")
