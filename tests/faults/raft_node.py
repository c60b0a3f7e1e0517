"""One bare Raft node (mqttring's pysyncobj setup, no broker) for ``test_prevote.py``.

Run inside a fault namespace; prints one JSON line per 50 ms with its term, its leader and
whether it leads, and exits when stdin closes (its test ended) or after ``--seconds``.

``--plain`` runs the same node with pre-vote and the leader lease switched off: the test's
control, which shows that its fault really does depose a leader without them.

SIGUSR1 raises the node's term by 3 on its Raft thread, as if it had campaigned where
nobody heard it: the state a node was found in once after the fault suite's ``sick``
scenario, however it got there (``prevote.STALE_TERM``).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from typing import Any

from mqttring.raft import replicated
from mqttring.raft.replicated import ReplicatedMetadata, make_syncobj


class _Ungated(replicated.ElectionGatedSyncObj):
    """pysyncobj's own elections: no pre-vote round, no lease."""

    def _gate_election(self, now: float) -> None:
        return None

    def screen_message(self, node: Any, message: Any) -> bool:
        return True


class _Inflatable(replicated.ElectionGatedSyncObj):
    """The product's node, whose term SIGUSR1 raises (on the Raft thread, in its tick)."""

    inflate = threading.Event()

    def _onTick(self, timeToWait: float = 0.0) -> None:
        if self.inflate.is_set():
            self.inflate.clear()
            self._SyncObj__setCurrentTerm(self.raftCurrentTerm + 3, None)
        super()._onTick(timeToWait)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--self", required=True)
    parser.add_argument("--peers", required=True)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--plain", action="store_true")
    args = parser.parse_args()
    if args.plain:
        replicated.ElectionGatedSyncObj = _Ungated  # type: ignore[misc]
    else:
        replicated.ElectionGatedSyncObj = _Inflatable  # type: ignore[misc]
        signal.signal(signal.SIGUSR1, lambda *_: _Inflatable.inflate.set())
    node = make_syncobj(args.self, args.peers.split(","),
                        ReplicatedMetadata(lambda _state: None), "prevote-test", None)
    stdin_closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stdin_closed.set()),
                     daemon=True).start()
    deadline = time.monotonic() + args.seconds
    try:
        while not stdin_closed.is_set() and time.monotonic() < deadline:
            leader = node._getLeader()
            print(json.dumps({"term": node.raftCurrentTerm, "is_leader": node._isLeader(),
                              "leader": None if leader is None else leader.address}),
                  flush=True)
            time.sleep(0.05)
    finally:
        node.destroy()


if __name__ == "__main__":
    main()
