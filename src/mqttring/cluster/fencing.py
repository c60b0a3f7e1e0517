"""Fencing decisions, apart from any I/O: whose frames may be applied here.

A node that was cut off and declared down keeps running, and whatever it queued or decided
on its stale view would, after the heal, reach its peers like any other traffic.  Each link
frame therefore carries the sender's incarnation (a number the metadata state machine
raises every time a node rejoins), and the receiver judges it against its own view:

* a newer incarnation than the view knows, or a node the view does not know yet, is a node
  joining or rejoining whose admission the receiver has not applied yet: admitted;
* an older incarnation is an ended life: refused;
* the view's incarnation is admitted unless the view declared that incarnation down.

Refusal is final for that frame (it is counted and the link is closed); the sender learns
from the view that it was declared down, drops its queues and rejoins in a new incarnation.
"""

from __future__ import annotations

from mqttring.raft.view import ClusterView, MemberState


def admit_frame(view: ClusterView, node: str, incarnation: int) -> bool:
    """May a frame that ``node`` stamped with ``incarnation`` be applied under ``view``?"""
    member = view.members.get(node)
    if member is None or incarnation > member.incarnation:
        return True
    if incarnation < member.incarnation:
        return False
    return member.state is not MemberState.DOWN


__all__ = ["admit_frame"]
