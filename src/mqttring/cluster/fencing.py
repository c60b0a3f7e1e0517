"""Fencing decisions, apart from any I/O: whose frames may be applied here.

A node that was cut off and declared down keeps running, and whatever it queued or decided
on its stale view would, after the heal, reach its peers like any other traffic.  Each link
frame therefore carries the sender's incarnation (a number the metadata state machine
raises every time a node rejoins), and the receiver judges it against its own view:

* a newer incarnation than the view knows, or a node the view does not know yet, is a node
  joining or rejoining whose admission the receiver has not applied yet: admitted;
* an older incarnation is an ended life: refused;
* the view's incarnation is admitted unless the view declared that incarnation down;
* a node that knows it was declared down applies nothing until it has rejoined;
* whoever sent it, a frame stamped with an epoch older than the one in which the receiver's
  own current incarnation began was packed for the receiver's previous life (the sender
  had not seen it rejoin): refused too.  This is what stops data that sat in a kernel's
  send buffer across a partition, or on a link to a node's earlier process, from being
  applied by the node's new life after the heal.

Refusal is final for that frame: it is counted, never applied, and acknowledged so that
the link does not replay it (``cluster/replay.py``); the sender learns from the view that
it was declared down, drops its queues and rejoins in a new incarnation.
"""

from __future__ import annotations

from mqttring.raft.view import ClusterView, MemberState


def admit_frame(view: ClusterView, me: str, node: str, incarnation: int, epoch: int) -> bool:
    """May a frame that ``node`` stamped with ``(incarnation, epoch)`` be applied by ``me``
    under ``view``?"""
    mine = view.members.get(me)
    if mine is not None and (epoch < mine.since or mine.state is MemberState.DOWN):
        return False  # for an earlier life of ours, or we are between lives
    member = view.members.get(node)
    if member is None or incarnation > member.incarnation:
        return True
    if incarnation < member.incarnation:
        return False
    return member.state is not MemberState.DOWN


__all__ = ["admit_frame"]
