"""Elections of real pysyncobj nodes with pre-vote and the lease (``raft/prevote.py``).

A leadership transfer still completes under the leader lease.

A transfer makes the chosen follower campaign while the old leader is alive and sending
heartbeats, so every other node is inside its lease and would drop the vote request
(``mqttring.raft.prevote``).  The request therefore says it comes from a transfer, and
this checks, with three real pysyncobj nodes on loopback, that the lead moves at once, to
the next term.  (A node leaving the cluster hands over its lead this way.)
"""

from __future__ import annotations

import socket
import time

import pytest
from pysyncobj import SyncObj

from mqttring.raft.prevote import PRE_VOTE, PRE_VOTE_RESPONSE
from mqttring.raft.replicated import ElectionGatedSyncObj, ReplicatedMetadata, make_syncobj

pytestmark = pytest.mark.timeout(60)


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _wait_for(check: object, timeout: float) -> SyncObj | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()  # type: ignore[operator]
        if found is not None:
            return found  # type: ignore[no-any-return]
        time.sleep(0.02)
    return None


def test_a_leadership_transfer_moves_the_lead_at_once_despite_the_lease() -> None:
    addresses = [_free_address() for _ in range(3)]
    nodes = [make_syncobj(a, addresses, ReplicatedMetadata(lambda _state: None), "pw", None)
             for a in addresses]
    try:
        assert all(isinstance(n, ElectionGatedSyncObj) for n in nodes)

        def sole_leader() -> SyncObj | None:
            leaders = [n for n in nodes if n._isLeader()]
            others_agree = all(n._getLeader() is not None for n in nodes)
            return leaders[0] if len(leaders) == 1 and others_agree else None

        old = _wait_for(sole_leader, 20)
        assert old is not None, "no leader elected"
        term = old.raftCurrentTerm
        # pysyncobj refuses a target whose log is behind: wait until all have applied it.
        assert _wait_for(lambda: True if all(n.raftCommitIndex == old.raftCommitIndex
                                             for n in nodes) else None, 10)
        answers: list[object] = []
        old.transferLeadership(callback=lambda _res, err: answers.append(err))
        new = _wait_for(lambda: next((n for n in nodes if n is not old and n._isLeader()),
                                     None), 3)
        assert new is not None, (f"the lead did not move within 3 s (transfer answered "
                                 f"{answers}); leaders: {[n._isLeader() for n in nodes]}")
        assert new.raftCurrentTerm == term + 1
    finally:
        for node in nodes:
            node.destroy()


class _Peer:
    id = "127.0.0.1:1"


@pytest.mark.parametrize("message", [
    {"type": PRE_VOTE, "term": "9", "last_log_term": 0, "last_log_index": 0},
    {"type": PRE_VOTE},
    {"type": PRE_VOTE_RESPONSE, "term": 1, "granted": "yes"},
])
def test_a_malformed_pre_vote_from_a_peer_is_dropped_and_the_node_goes_on(
        message: dict[str, object]) -> None:
    address = _free_address()
    node = make_syncobj(address, [address], ReplicatedMetadata(lambda _state: None), "pw",
                        None)
    try:
        assert isinstance(node, ElectionGatedSyncObj)
        assert node.screen_message(_Peer(), message) is False  # never reaches pysyncobj
        assert _wait_for(lambda: True if node._isLeader() else None, 10)
    finally:
        node.destroy()
