"""Pre-vote and the leader lease: who may start a Raft election, decided without I/O.

pysyncobj's Raft (like the Raft paper's first form) lets any follower that misses the
leader's heartbeats for an election timeout raise its term and ask for votes.  The higher
term alone deposes the leader: every node that sees it steps down, whether or not the
candidate can win.  A node that hears the leader badly (a lossy NIC, a half-cut link)
therefore deposes a healthy leader again and again, and can win: measured in the fault
suite's ``sick`` scenario, a node losing 40% of its packets took the lead, and the healthy
nodes, which prove their quorum through the leader's answers, fenced themselves.  A node
cut off from the leader but not from the others does the same (the terms it inflated while
cut off depose each new leader after a partition heals).

Two rules from the Raft thesis (section 9.6) and etcd stop that:

* **Pre-vote.**  Before raising its term a would-be candidate asks the others whether they
  *would* vote for it at the next term (``PreVoteRequest``); nobody changes any state to
  answer.  Only with a majority of yeses does it start the real election.  A node nobody
  would elect never raises its term, so it never deposes anyone.
* **The leader lease.**  A node that has heard from a leader within ``lease`` (the minimum
  election timeout) answers no to a pre-vote and ignores a real vote request: the leader
  it hears is alive, whatever the candidate thinks.  A leader counts as in its own lease.
  The one exception is a vote request that a leader asked for, a leadership transfer
  (``transfer``), which must win while the old leader still sends heartbeats.

A term that got ahead anyway is brought back by ``STALE_TERM`` (one election).

Liveness is unchanged where it matters: when the leader dies or is cut off from a majority,
the majority stops hearing it, their leases run out together one election timeout later,
and they grant each other's pre-votes as before.  The cost is one round trip before each
election.

``ElectionGate`` holds one node's side of both rules; ``replicated.py`` feeds it pysyncobj's
messages and fields on the Raft thread and carries out what it says.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Message types on pysyncobj's transport (pysyncobj ignores types it does not know, so a
#: node without pre-vote never answers, and counts as a no).
PRE_VOTE = "mqttring_pre_vote"
PRE_VOTE_RESPONSE = "mqttring_pre_vote_response"
#: The key a transfer's vote request carries, so that leases do not refuse it.
TRANSFER_KEY = "mqttring_transfer"
#: A node's answer to append-entries from a leader of a lower term: ``{"type": STALE_TERM,
#: "term": its term}``.  pysyncobj drops such append-entries without a word, and its only
#: other way to learn a higher term is a vote request, which the leases drop: a node whose
#: term got ahead (measured once in the fault suite's ``sick`` scenario: term 2 against the
#: leader's 1, after the node was declared down) then never follows the leader again, nor
#: learns that it must rejoin.  The leader steps down on it instead, as Raft wants of any
#: higher term, and the next election, at a higher term still, takes every node along (what
#: etcd's raft does in the same case, with an append response).
STALE_TERM = "mqttring_stale_term"


class BadPreVoteMessage(ValueError):
    """A peer's pre-vote message has the wrong fields or types: it is dropped."""


def _int_field(message: Mapping[str, Any], key: str) -> int:
    value = message.get(key)
    if type(value) is not int or value < 0:
        raise BadPreVoteMessage(f"{key!r} must be a non-negative integer, not {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class LogPosition:
    """A node's last log entry: candidates are compared by (term, index), as in Raft."""

    term: int
    index: int

    def at_least(self, other: LogPosition) -> bool:
        return (self.term, self.index) >= (other.term, other.index)


@dataclass(frozen=True, slots=True)
class PreVoteRequest:
    """"Would you vote for me at ``term``, given my log ends at ``log``?" """

    term: int
    log: LogPosition

    def to_message(self) -> dict[str, Any]:
        return {"type": PRE_VOTE, "term": self.term, "last_log_term": self.log.term,
                "last_log_index": self.log.index}

    @classmethod
    def from_message(cls, message: Mapping[str, Any]) -> PreVoteRequest:
        return cls(_int_field(message, "term"),
                   LogPosition(_int_field(message, "last_log_term"),
                               _int_field(message, "last_log_index")))


@dataclass(frozen=True, slots=True)
class PreVoteResponse:
    """The answer to the pre-vote for ``term``."""

    term: int
    granted: bool

    def to_message(self) -> dict[str, Any]:
        return {"type": PRE_VOTE_RESPONSE, "term": self.term, "granted": self.granted}

    @classmethod
    def from_message(cls, message: Mapping[str, Any]) -> PreVoteResponse:
        granted = message.get("granted")
        if type(granted) is not bool:
            raise BadPreVoteMessage(f"'granted' must be a boolean, not {granted!r}")
        return cls(_int_field(message, "term"), granted)


class ElectionGate:
    """One node's pre-vote round and leader lease (see the module docstring).

    Times are the caller's monotonic clock; terms and logs are the caller's Raft state at
    the moment of the call.  Nothing here sends or schedules anything.
    """

    def __init__(self, lease: float) -> None:
        self.lease = lease
        self._leader_heard_at: float | None = None
        self._round_term: int | None = None  # the term the open pre-vote round asks for
        self._voters = 0
        self._yes: set[str] = set()
        self._won_term: int | None = None

    # -- the lease -------------------------------------------------------------------

    def heard_from_leader(self, now: float) -> None:
        """A current leader's append-entries (term not below ours) arrived."""
        self._leader_heard_at = now

    def in_lease(self, now: float, is_leader: bool) -> bool:
        if is_leader:
            return True
        heard = self._leader_heard_at
        return heard is not None and now - heard < self.lease

    def admit_vote_request(self, now: float, is_leader: bool,
                           message: Mapping[str, Any]) -> bool:
        """Whether a real vote request may reach Raft: not inside the lease, unless it is
        a leadership transfer."""
        return message.get(TRANSFER_KEY) is True or not self.in_lease(now, is_leader)

    def answer(self, now: float, is_leader: bool, current_term: int, log: LogPosition,
               request: PreVoteRequest) -> PreVoteResponse:
        """Yes exactly when a real vote at ``request.term`` would be granted by Raft's log
        rule and no leader is heard within the lease.  Answering changes nothing."""
        granted = (request.term > current_term and request.log.at_least(log)
                   and not self.in_lease(now, is_leader))
        return PreVoteResponse(request.term, granted)

    # -- this node's own round -------------------------------------------------------

    def start_round(self, current_term: int, log: LogPosition, voters: int,
                    self_id: str) -> PreVoteRequest:
        """Open a round for ``current_term + 1`` among ``voters`` members (this node
        included), replacing any earlier round; this node votes for itself."""
        self._round_term = current_term + 1
        self._voters = voters
        self._yes = {self_id}
        self._won_term = None
        self._check_won()
        return PreVoteRequest(current_term + 1, log)

    def on_response(self, sender: str, response: PreVoteResponse) -> bool:
        """Count an answer; True the first time the round has a majority."""
        if (response.term != self._round_term or not response.granted
                or self._won_term is not None):
            return False
        self._yes.add(sender)
        return self._check_won()

    def _check_won(self) -> bool:
        if self._round_term is not None and len(self._yes) * 2 > self._voters:
            self._won_term = self._round_term
            return True
        return False

    def may_campaign(self, current_term: int) -> bool:
        """Whether a round for ``current_term + 1`` has won: the real election may start."""
        return self._won_term is not None and self._won_term == current_term + 1

    def campaign_started(self) -> None:
        """The real election started: the won round is spent."""
        self._round_term = None
        self._won_term = None
        self._yes = set()
