"""Pre-vote and the leader lease, decided without I/O (``mqttring.raft.prevote``).

The processes-and-namespaces side (a node cut from the leader alone does not depose it; a
leader cut from everyone is replaced) is ``tests/faults/test_prevote.py``.
"""

from __future__ import annotations

import pytest

from mqttring.raft.prevote import (
    PRE_VOTE,
    TRANSFER_KEY,
    BadPreVoteMessage,
    ElectionGate,
    LogPosition,
    PreVoteRequest,
    PreVoteResponse,
)

LEASE = 0.4
LOG = LogPosition(term=3, index=10)


def _request(term: int = 4, log: LogPosition = LOG) -> PreVoteRequest:
    return PreVoteRequest(term, log)


def test_a_node_that_hears_its_leader_refuses_pre_votes_until_the_lease_runs_out() -> None:
    gate = ElectionGate(LEASE)
    gate.heard_from_leader(100.0)
    assert not gate.answer(100.3, False, 3, LOG, _request()).granted
    assert gate.answer(100.41, False, 3, LOG, _request()).granted


def test_a_leader_refuses_pre_votes() -> None:
    gate = ElectionGate(LEASE)
    assert not gate.answer(100.0, True, 3, LOG, _request()).granted


def test_a_node_that_never_heard_a_leader_grants_an_up_to_date_candidate() -> None:
    answer = ElectionGate(LEASE).answer(5.0, False, 3, LOG, _request())
    assert answer == PreVoteResponse(4, True)


@pytest.mark.parametrize("candidate", [LogPosition(2, 50), LogPosition(3, 9)])
def test_a_candidate_whose_log_is_behind_is_refused(candidate: LogPosition) -> None:
    assert not ElectionGate(LEASE).answer(5.0, False, 3, LOG, _request(4, candidate)).granted


def test_a_pre_vote_for_a_term_not_above_ours_is_refused() -> None:
    assert not ElectionGate(LEASE).answer(5.0, False, 4, LOG, _request(4)).granted


def test_answering_changes_nothing() -> None:
    gate = ElectionGate(LEASE)
    gate.heard_from_leader(1.0)
    gate.answer(1.1, False, 3, LOG, _request())
    gate.answer(9.0, False, 3, LOG, _request())
    assert gate.in_lease(1.2, False) and not gate.in_lease(9.0, False)
    assert not gate.may_campaign(3)


def test_the_lease_drops_vote_requests_except_a_transfer() -> None:
    gate = ElectionGate(LEASE)
    gate.heard_from_leader(10.0)
    vote = {"type": "request_vote", "term": 4}
    assert not gate.admit_vote_request(10.1, False, vote)
    assert not gate.admit_vote_request(10.1, True, vote)
    assert gate.admit_vote_request(10.1, False, {**vote, TRANSFER_KEY: True})
    assert gate.admit_vote_request(10.5, False, vote)
    assert not gate.admit_vote_request(10.5, True, vote)  # a leader is in its own lease


def test_a_round_wins_on_a_majority_of_yeses_and_only_for_its_term() -> None:
    gate = ElectionGate(LEASE)
    request = gate.start_round(3, LOG, voters=5, self_id="a")
    assert request == PreVoteRequest(4, LOG)
    assert not gate.may_campaign(3)
    assert not gate.on_response("b", PreVoteResponse(4, False))
    assert not gate.on_response("c", PreVoteResponse(5, True))  # another round's
    assert not gate.on_response("b", PreVoteResponse(4, True))
    assert not gate.on_response("b", PreVoteResponse(4, True))  # the same voter twice
    assert gate.on_response("d", PreVoteResponse(4, True))  # a, b, d: 3 of 5
    assert not gate.on_response("e", PreVoteResponse(4, True))  # won once
    assert gate.may_campaign(3)
    assert not gate.may_campaign(4)  # the term moved on: the round is stale
    gate.campaign_started()
    assert not gate.may_campaign(3)


def test_a_new_round_forgets_the_yeses_of_the_last() -> None:
    gate = ElectionGate(LEASE)
    gate.start_round(3, LOG, voters=3, self_id="a")
    gate.start_round(3, LOG, voters=5, self_id="a")
    assert not gate.on_response("b", PreVoteResponse(4, True))
    assert gate.on_response("c", PreVoteResponse(4, True))


def test_messages_round_trip() -> None:
    request = _request()
    assert PreVoteRequest.from_message(request.to_message()) == request
    assert request.to_message()["type"] == PRE_VOTE
    response = PreVoteResponse(4, True)
    assert PreVoteResponse.from_message(response.to_message()) == response


@pytest.mark.parametrize("message", [
    {"type": PRE_VOTE},
    {"type": PRE_VOTE, "term": "4", "last_log_term": 3, "last_log_index": 10},
    {"type": PRE_VOTE, "term": 4, "last_log_term": -1, "last_log_index": 10},
    {"type": PRE_VOTE, "term": True, "last_log_term": 3, "last_log_index": 10},
    {"type": PRE_VOTE, "term": 4, "last_log_term": 3, "last_log_index": None},
])
def test_a_malformed_pre_vote_is_a_typed_error(message: dict[str, object]) -> None:
    with pytest.raises(BadPreVoteMessage):
        PreVoteRequest.from_message(message)


@pytest.mark.parametrize("message", [{"term": 4}, {"term": 4, "granted": 1},
                                     {"term": -4, "granted": True}])
def test_a_malformed_pre_vote_answer_is_a_typed_error(message: dict[str, object]) -> None:
    with pytest.raises(BadPreVoteMessage):
        PreVoteResponse.from_message(message)
