"""Who is alive, decided without I/O: the leader's failure detector and a node's quorum proof.

``MetadataService`` runs the loops (heartbeats out, the leader's periodic check, the
fencing watch) and feeds these two objects the facts with trio's clock; they only decide,
so the rules below are unit-tested without processes or sockets.

* ``FailureDetector`` (leader only): a member whose last heartbeat is older than
  ``failure_grace`` is due to be marked down.  A node that has just become leader has no
  record of anyone, so every member gets a full grace period from that moment: a new
  leader never marks a live member down for silence it did not witness.  The same holds
  after the leader's own pause (SIGSTOP, a VM or swap stall, a long collection): checks
  further apart than ``stall`` mean the heartbeats of the gap may still be unread in its
  sockets, so the record starts again there (a probe: a 2-node cluster's leader stopped
  for 8-10 s marked its live follower down the moment it resumed).
* ``QuorumProof``: the latest moment this node proved it is in the majority's view, dated
  ``leader_fallback`` back (a deposed leader on the minority side believes it leads for up
  to that long; ``service.py``'s module docstring has the whole argument).
* ``admission``: whether a node that just joined may serve, must wait for its own replica
  of the view, or was marked down meanwhile and must join again.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from mqttring.raft.view import ClusterView, Member, MemberState


class Admission(enum.Enum):
    MEMBER = "member"  # this replica shows the node up in this life: it may serve
    WAIT = "wait"  # not yet: wait for the next view
    REJOIN = "rejoin"  # marked down before it ever saw itself up: join again


def admission(view: ClusterView, node_id: str, incarnation: int, admitted: int) -> Admission:
    """Where a node admitted with ``incarnation`` at epoch ``admitted`` stands in ``view``
    (its own replica, which may lag the leader's).

    It heartbeats only once it is a member, so one that takes longer than
    ``failure_grace`` to see itself up (starved of CPU, stopped, a replica slow to catch up)
    is marked down first.  Its replica may then never show it up at all (it catches up
    straight to the view that has it down), and before 2026-11-29 it waited for that for
    ever, serving nothing (a fault probe: 3 times, once after a rolling restart).  It joins
    again instead, as a member marked down does (``_heartbeat_loop``).
    """
    me = view.members.get(node_id)
    if me is None or view.epoch < admitted or me.incarnation < incarnation:
        return Admission.WAIT
    if me.state is MemberState.UP:
        return Admission.MEMBER
    if me.state is MemberState.DOWN:
        return Admission.REJOIN
    return Admission.WAIT


class FailureDetector:
    """The leader's record of heartbeats (see the module docstring)."""

    def __init__(self, grace: float, stall: float | None = None) -> None:
        self.grace = grace
        #: Seconds between two checks past which this node counts itself as having been
        #: stalled (None: never); the service checks several times a second.
        self.stall = stall
        self._last_seen: dict[str, float] = {}
        self._leading_since: float | None = None
        self._checked_at: float | None = None

    def heard(self, node_id: str, now: float) -> None:
        """A heartbeat (or a join) from ``node_id`` at ``now``."""
        self._last_seen[node_id] = now

    def not_leading(self) -> None:
        """This node is not the leader: when it leads again, it starts with no record."""
        self._leading_since = None
        self._checked_at = None

    def silent(self, now: float, members: Iterable[Member], me: str
               ) -> list[tuple[Member, float]]:
        """The members (not ``me``, not down already) silent for longer than the grace, each
        with how long; called while leading."""
        stalled = (self.stall is not None and self._checked_at is not None
                   and now - self._checked_at > self.stall)
        self._checked_at = now
        if self._leading_since is None or stalled:
            self._leading_since = now
            self._last_seen.clear()
        due = []
        for member in members:
            if member.node_id == me or member.state is MemberState.DOWN:
                continue
            quiet = now - self._last_seen.get(member.node_id, self._leading_since)
            if quiet > self.grace:
                due.append((member, quiet))
        return due


class QuorumProof:
    """When this node last proved that it belongs to the majority's view."""

    def __init__(self, leader_fallback: float) -> None:
        self.leader_fallback = leader_fallback
        self._at: float | None = None

    def proved(self, at: float) -> None:
        """A proof had at ``at``: being leader then, admitted by a leader then, or a
        heartbeat *sent* then and answered by a leader that counts this node up."""
        self._at = at - self.leader_fallback

    def holds(self, now: float, within: float) -> bool:
        """Proved at most ``within`` seconds before ``now`` (dating included)."""
        return self._at is not None and now - self._at <= within


__all__ = ["FailureDetector", "QuorumProof"]
