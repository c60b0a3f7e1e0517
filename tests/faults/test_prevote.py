"""Pre-vote and the leader lease with real Raft nodes, in separate processes, in network
namespaces (``netns.py``), with nftables cutting the links.

* A follower cut from the leader alone (it still reaches the third node) must not depose
  the leader: without pre-vote it raises its term, the third node follows that term, and
  the leader loses its majority.  The test runs the same fault on nodes with pre-vote off
  first, and requires that control to depose its leader, so a fault too gentle to matter
  cannot pass for a fix.
* A leader cut from everyone must still be replaced (pre-vote must not cost liveness), and
  once healed it must follow the new leader rather than depose it.
* A follower whose term got ahead of the leader's anyway must be taken back: the leases
  drop its vote requests and pysyncobj drops the leader's older append-entries, so without
  ``prevote.STALE_TERM`` it followed nobody, for good.

Skipped, like the fault suite, only when network namespaces cannot be created here.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .netns import IP, Topology, can_create_namespaces, remove_stale

ROOT = Path(__file__).resolve().parents[2]
RAFT_PORT = 7100
NAMES = ["n1", "n2", "n3"]  # "c" and "h" name the client and hub namespaces
#: How long the fault lasts: several election timeouts (0.4-0.8 s) and more than the
#: leader's step-down timeout (2 s), so that a node free to campaign does.
FAULT_S = 5.0

pytestmark = pytest.mark.timeout(150)


@dataclass
class RaftNode:
    name: str
    address: str
    popen: subprocess.Popen[str]
    latest: dict[str, object] = field(default_factory=dict)
    terms: list[int] = field(default_factory=list)
    lines: queue.SimpleQueue[str] = field(default_factory=queue.SimpleQueue)

    def follow(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line)

    def drain(self) -> None:
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return
            status = json.loads(line)
            self.latest = status
            self.terms.append(int(status["term"]))


class Cluster:
    def __init__(self, topo: Topology, plain: bool) -> None:
        self.topo = topo
        addresses = {n: f"{topo.addresses[n]}:{RAFT_PORT}" for n in NAMES}
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
        self.nodes: dict[str, RaftNode] = {}
        for name in NAMES:
            cmd = [IP, "netns", "exec", topo.namespaces[name], sys.executable, "-m",
                   "tests.faults.raft_node", "--self", addresses[name],
                   "--peers", ",".join(addresses.values()), "--seconds", "140"]
            popen = subprocess.Popen(cmd + (["--plain"] if plain else []), cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            node = RaftNode(name, addresses[name], popen)
            threading.Thread(target=node.follow, daemon=True).start()
            self.nodes[name] = node

    def stop(self) -> None:
        for node in self.nodes.values():
            if node.popen.stdin is not None:
                node.popen.stdin.close()
        for node in self.nodes.values():
            try:
                node.popen.wait(10)
            except subprocess.TimeoutExpired:
                node.popen.kill()
                node.popen.wait(10)

    def wait_for(self, what: str, check: Callable[[], str | None], timeout: float) -> str:
        """Poll the nodes' status lines until ``check`` names a node (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for node in self.nodes.values():
                node.drain()
                assert node.popen.poll() is None, f"raft node {node.name} exited"
            found = check()
            if found is not None:
                return found
            time.sleep(0.05)
        states = {n: node.latest for n, node in self.nodes.items()}
        raise AssertionError(f"{what} not within {timeout} s: {states}")

    def agreed_leader(self, among: list[str] | None = None) -> str | None:
        """The node that ``among`` (default: all) all see as leader, at one term."""
        names = among or NAMES
        latest = [self.nodes[n].latest for n in names]
        if not all(latest) or len({s["leader"] for s in latest}) != 1 or \
                len({s["term"] for s in latest}) != 1:
            return None
        for name, node in self.nodes.items():
            if node.address == latest[0]["leader"] and name in names \
                    and node.latest.get("is_leader"):
                return name
        return None

    def term(self, name: str) -> int:
        return int(self.nodes[name].latest["term"])

    def observe(self, seconds: float) -> None:
        """Collect status lines for ``seconds`` (the fault's length: a fixed window, not a
        wait for a condition)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for node in self.nodes.values():
                node.drain()
            time.sleep(0.05)


@pytest.fixture
def topology() -> Iterator[Topology]:
    ok, why = can_create_namespaces()
    if not ok:
        pytest.skip(f"needs network namespaces: {why}")
    remove_stale()
    topo = Topology(NAMES)
    try:
        topo.setup()
        yield topo
    finally:
        topo.teardown()


def _cut_follower_from_leader(topo: Topology, plain: bool) -> tuple[int, dict[str, int], str]:
    """Start three nodes, cut one follower from the leader for ``FAULT_S``; return the
    term before, the highest term each node reached, and who led at the end."""
    cluster = Cluster(topo, plain)
    try:
        leader = cluster.wait_for("a leader all agree on", cluster.agreed_leader, 30)
        term = cluster.term(leader)
        follower = next(n for n in NAMES if n != leader)
        for node in cluster.nodes.values():
            node.terms.clear()
        topo.cut(follower, [leader])
        topo.cut(leader, [follower])
        cluster.observe(FAULT_S)
        topo.heal()
        final = cluster.wait_for("a leader after the heal", cluster.agreed_leader, 20)
        return term, {n: max(node.terms, default=term) for n, node in
                      cluster.nodes.items()}, ("same" if final == leader else final)
    finally:
        topo.heal()
        cluster.stop()


def test_a_follower_cut_from_the_leader_alone_does_not_depose_it(topology: Topology) -> None:
    term, control_terms, control_end = _cut_follower_from_leader(topology, plain=True)
    assert max(control_terms.values()) > term, (
        "control: with pre-vote off the cut follower never raised its term, so this fault "
        f"cannot tell pre-vote's effect (terms {control_terms}, before {term})")
    term, terms, end = _cut_follower_from_leader(topology, plain=False)
    assert terms == dict.fromkeys(NAMES, term), (
        f"with pre-vote a term rose during the cut (before {term}, highest {terms}); "
        f"control: {control_terms}, leader at its end: {control_end}")
    assert end == "same", f"the leader changed: {end} leads after the heal"


def test_a_leader_cut_from_everyone_is_replaced_and_then_follows(topology: Topology) -> None:
    cluster = Cluster(topology, plain=False)
    try:
        old = cluster.wait_for("a leader all agree on", cluster.agreed_leader, 30)
        term = cluster.term(old)
        others = [n for n in NAMES if n != old]
        topology.isolate(old)
        new = cluster.wait_for(
            "a new leader on the majority side",
            lambda: cluster.agreed_leader(others) if cluster.term(others[0]) > term else None,
            10)
        new_term = cluster.term(new)
        topology.heal()
        final = cluster.wait_for("all three agreeing after the heal", cluster.agreed_leader,
                                 10)
        assert final == new, f"the healed old leader {old} deposed {new}: {final} leads"
        assert cluster.term(final) == new_term
    finally:
        topology.heal()
        cluster.stop()


def test_a_follower_whose_term_got_ahead_is_taken_back(topology: Topology) -> None:
    cluster = Cluster(topology, plain=False)
    try:
        leader = cluster.wait_for("a leader all agree on", cluster.agreed_leader, 30)
        term = cluster.term(leader)
        follower = next(n for n in NAMES if n != leader)
        os.kill(cluster.nodes[follower].popen.pid, signal.SIGUSR1)
        cluster.wait_for("the follower's term raised",
                         lambda: follower if cluster.term(follower) > term else None, 5)

        def all_along() -> str | None:
            agreed = cluster.agreed_leader()
            return agreed if agreed is not None and cluster.term(agreed) >= term + 3 else None

        final = cluster.wait_for("all three following one leader at the follower's term or "
                                 "later", all_along, 15)
        assert final is not None
    finally:
        cluster.stop()
