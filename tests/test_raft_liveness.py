"""The failure detector, the quorum proof and peers.json, without processes or sockets."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from mqttring.raft.liveness import Admission, FailureDetector, QuorumProof, admission
from mqttring.raft.peers import PeersFile
from mqttring.raft.view import EMPTY_VIEW, ClusterView, Member, MemberState


def member(node_id: str, state: MemberState = MemberState.UP, incarnation: int = 1) -> Member:
    return Member(node_id, f"127.0.0.1:{1883}", f"127.0.0.1:7{ord(node_id)}",
                  f"127.0.0.1:8{ord(node_id)}", state, incarnation)


MEMBERS = [member("a"), member("b"), member("c"), member("d", MemberState.DOWN)]


def names(due: list[tuple[Member, float]]) -> list[str]:
    return [m.node_id for m, _ in due]


def test_a_new_leader_gives_everyone_a_full_grace_period() -> None:
    detector = FailureDetector(grace=4.0)
    detector.heard("b", 0.0)  # heard before leading: forgotten when leading starts
    assert detector.silent(100.0, MEMBERS, me="a") == []
    assert detector.silent(104.0, MEMBERS, me="a") == []  # exactly the grace: not yet
    due = detector.silent(104.5, MEMBERS, me="a")
    # Never itself, never a member that is down already; how long each was quiet.
    assert names(due) == ["b", "c"]
    assert [quiet for _, quiet in due] == [4.5, 4.5]


def test_a_heartbeat_keeps_a_member_up_and_silence_after_it_counts() -> None:
    detector = FailureDetector(grace=4.0)
    assert detector.silent(10.0, MEMBERS, me="a") == []
    detector.heard("b", 13.0)
    assert names(detector.silent(14.5, MEMBERS, me="a")) == ["c"]
    assert names(detector.silent(17.5, MEMBERS, me="a")) == ["b", "c"]


def test_leadership_lost_and_regained_starts_a_new_record() -> None:
    detector = FailureDetector(grace=4.0)
    detector.silent(0.0, MEMBERS, me="a")
    detector.heard("b", 1.0)
    detector.not_leading()
    # Leading again at 50: the silence it did not witness (1..50) does not count.
    assert detector.silent(50.0, MEMBERS, me="a") == []
    assert names(detector.silent(54.1, MEMBERS, me="a")) == ["b", "c"]


def test_a_leader_that_was_stalled_gives_everyone_a_new_grace_period() -> None:
    """Checks ``stall`` apart or more: the leader itself was stopped, the heartbeats of the
    gap may be unread yet; silence it saw before the stall still counts once it is over."""
    detector = FailureDetector(grace=4.0, stall=2.0)
    detector.silent(0.0, MEMBERS, me="a")
    detector.heard("b", 0.5)
    detector.heard("c", 0.5)
    detector.silent(1.0, MEMBERS, me="a")
    assert detector.silent(11.0, MEMBERS, me="a") == []  # stopped from 1 to 11
    detector.heard("b", 12.0)
    assert detector.silent(13.0, MEMBERS, me="a") == []
    assert detector.silent(14.5, MEMBERS, me="a") == []  # checks 1.5 s apart: no stall
    assert names(detector.silent(15.5, MEMBERS, me="a")) == ["c"]  # 4.5 s quiet since 11
    # Without the stall rule the same sequence marks both down at 11.
    plain = FailureDetector(grace=4.0)
    plain.silent(0.0, MEMBERS, me="a")
    plain.heard("b", 0.5)
    plain.heard("c", 0.5)
    assert names(plain.silent(11.0, MEMBERS, me="a")) == ["b", "c"]


def test_a_quorum_proof_is_dated_back_and_expires() -> None:
    proof = QuorumProof(leader_fallback=1.0)
    assert not proof.holds(0.0, within=3.0)  # never proved
    proof.proved(10.0)  # counts as had at 9.0
    assert proof.holds(11.9, within=3.0)
    assert proof.holds(12.0, within=3.0)
    assert not proof.holds(12.1, within=3.0)
    proof.proved(12.0)
    assert proof.holds(14.0, within=3.0)


def test_peers_file_round_trip_and_bad_files(tmp_path: Path, caplog) -> None:
    (tmp_path / "raft").mkdir()
    peers = PeersFile(tmp_path, "a")
    assert peers.load() == {}  # none yet
    view = replace(EMPTY_VIEW, epoch=7, members={m.node_id: m for m in MEMBERS})
    peers.save(view)
    saved = json.loads((tmp_path / "raft" / "peers.json").read_text())
    assert saved["epoch"] == 7
    assert PeersFile(tmp_path, "a").load() == {
        m.node_id: {"cluster": m.cluster, "raft": m.raft} for m in MEMBERS}
    # A view without this node is not remembered (it was removed: nothing to rejoin).
    PeersFile(tmp_path, "z").save(replace(view, epoch=8))
    assert json.loads((tmp_path / "raft" / "peers.json").read_text())["epoch"] == 7
    for garbage in ("not json", "[1, 2]", '{"epoch": 1}'):
        (tmp_path / "raft" / "peers.json").write_text(garbage)
        with caplog.at_level(logging.WARNING):
            assert PeersFile(tmp_path, "a").load() == {}
        assert "ignoring unreadable" in caplog.text
        caplog.clear()
    assert PeersFile(None, "a").load() == {}
    PeersFile(None, "a").save(view)  # no data directory: nothing written, no error


@pytest.mark.parametrize("grace", [0.5, 5.0])
def test_only_silence_longer_than_the_grace_counts(grace: float) -> None:
    detector = FailureDetector(grace)
    detector.silent(0.0, MEMBERS, me="a")
    detector.heard("b", 0.0)
    detector.heard("c", 0.0)
    assert detector.silent(grace, MEMBERS, me="a") == []
    assert names(detector.silent(grace * 1.01, MEMBERS, me="a")) == ["b", "c"]


def view_with(members: list[Member], epoch: int) -> ClusterView:
    return replace(EMPTY_VIEW, epoch=epoch, members={m.node_id: m for m in members})


@pytest.mark.parametrize(("me", "epoch", "expected"), [
    (member("d", MemberState.UP, 2), 7, Admission.MEMBER),
    (member("d", MemberState.UP, 3), 9, Admission.MEMBER),  # a later life counts
    (member("d", MemberState.JOINING, 2), 7, Admission.WAIT),
    (member("d", MemberState.UP, 1), 7, Admission.WAIT),  # its previous life
    (member("d", MemberState.UP, 2), 6, Admission.WAIT),  # before the admitting epoch
    (member("d", MemberState.DOWN, 2), 8, Admission.REJOIN),  # down before it saw itself up
    (member("d", MemberState.DOWN, 1), 8, Admission.WAIT),  # its previous life's death
    (member("d", MemberState.LEAVING, 2), 8, Admission.WAIT),
    (None, 8, Admission.WAIT),
])
def test_a_joined_node_serves_waits_or_joins_again(me, epoch, expected) -> None:
    """Node d joined with incarnation 2 at epoch 7; its own replica shows ``me``."""
    members = [member("a"), member("b")] + ([me] if me is not None else [])
    assert admission(view_with(members, epoch), "d", 2, 7) is expected
