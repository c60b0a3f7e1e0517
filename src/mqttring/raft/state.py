"""The replicated metadata state machine: members, epoch, shard placement, pins.

Theory of operation
-------------------
This is the only thing Raft replicates.  It is a plain object: ``apply(command)`` takes a
small dict of primitives (built by the ``cmd_*`` helpers below), changes the state and
returns a result dict.  It reads no clock, no randomness, no network and no process state,
so the same command log gives the same state on every node, at any time; the pysyncobj
shell in ``replicated.py`` only feeds it committed entries, and tests drive it directly.
``apply`` never raises for a bad command (that would kill pysyncobj's thread on every node
at once): it returns ``{"ok": False, "error": ...}`` and leaves the state untouched.

What it holds
~~~~~~~~~~~~~
* ``members``: node id -> ``Member`` (addresses, state, incarnation, weight).
* ``epoch``: bumped by every command that changes anything.  A view with a larger epoch is
  newer; the data plane tags forwarded messages with it.
* per shard, ``target`` (the ring placement over ``UP`` members, see
  ``mqttring.ring.placement``) and ``holders``: the nodes that hold the shard's current
  data.  The published replica list is derived from both (see ``ShardAssignment``).

Holding rules (the ``catching-up`` model)
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
* A node becomes a holder of a shard only through ``caught_up`` (its data plane finished
  the transfer for that incarnation) -- or at bootstrap, when there is no data yet.
* A node stops being a holder when it goes ``down`` or rejoins (a new incarnation: whatever
  it stored before missed the writes made while it was away) -- unless it is the shard's
  *last* holder.  Then its disk has the newest data that exists: the owner is always a
  holder, so no write of the shard can have been acknowledged since it went.  It stays the
  holder (and the owner), the shard unavailable meanwhile, until it is up again and serves
  what it stored, or until it is removed.  Dropping it instead would make empty targets
  the holders, and the node, back from a restart or a power loss of the whole cluster,
  would throw away the only copy to copy theirs.
* A removed node stops being a holder of everything (``mqttring leave --member``: the
  operator gives up on it and on what only it stored).
* A holder that is no longer a target (a *donor*) is kept while any target replica of the
  shard is still catching up, so the data has a source; once every target replica holds
  the data, holders become exactly the targets.
* If a shard has no holder left (its last holder was removed), the targets are declared
  holders: the data is gone and waiting would block the shard forever.  ``lost_shards``
  counts it.

Hence the owner (first replica) is always a holder; it is an ``UP`` (or ``LEAVING``) node
unless every holder of the shard is down or rejoining.  With at least R ``UP`` members every
shard lists at least R distinct ``UP`` nodes (its targets).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from mqttring.raft.view import ClusterView, Member, MemberState, ShardAssignment
from mqttring.ring.hashing import shard_of
from mqttring.ring.placement import place_shards

Command = dict[str, Any]
Result = dict[str, Any]


class Op(enum.StrEnum):
    BOOTSTRAP = "bootstrap"
    JOINING = "joining"
    UP = "up"
    DOWN = "down"
    LEAVING = "leaving"
    REMOVE = "remove"
    CAUGHT_UP = "caught_up"
    PIN = "pin"
    UNPIN = "unpin"


class CommandRejected(Exception):
    """A command that cannot apply to the current state; the state is left unchanged."""


def member_info(
    node_id: str, cluster: str, raft: str, mqtt: str | None = None, weight: int = 1
) -> dict[str, Any]:
    return {"node_id": node_id, "cluster": cluster, "raft": raft, "mqtt": mqtt, "weight": weight}


def cmd_bootstrap(num_shards: int, replication: int, member: dict[str, Any]) -> Command:
    return {"op": Op.BOOTSTRAP.value, "num_shards": num_shards, "replication": replication,
            "member": member}


def cmd_joining(member: dict[str, Any]) -> Command:
    return {"op": Op.JOINING.value, "member": member}


def cmd_up(node_id: str) -> Command:
    return {"op": Op.UP.value, "node_id": node_id}


def cmd_down(node_id: str, incarnation: int) -> Command:
    return {"op": Op.DOWN.value, "node_id": node_id, "incarnation": incarnation}


def cmd_leaving(node_id: str) -> Command:
    return {"op": Op.LEAVING.value, "node_id": node_id}


def cmd_remove(node_id: str) -> Command:
    return {"op": Op.REMOVE.value, "node_id": node_id}


def cmd_caught_up(node_id: str, incarnation: int, shards: list[int]) -> Command:
    return {"op": Op.CAUGHT_UP.value, "node_id": node_id, "incarnation": incarnation,
            "shards": list(shards)}


def cmd_pin(subtree: str, shard: int | None = None) -> Command:
    return {"op": Op.PIN.value, "subtree": subtree, "shard": shard}


def cmd_unpin(subtree: str) -> Command:
    return {"op": Op.UNPIN.value, "subtree": subtree}


def normalize_subtree(subtree: str) -> str:
    """``factory/line1/#`` and ``factory/line1`` name the same pinned subtree."""
    if subtree.endswith("/#"):
        subtree = subtree[:-2]
    if not subtree or "+" in subtree or "#" in subtree:
        raise CommandRejected(f"pin must be a topic subtree like 'a/b/#', got {subtree!r}")
    return subtree


class MetadataState:
    """Deterministic cluster metadata; see the module docstring for the rules."""

    def __init__(self) -> None:
        self.epoch = 0
        self.num_shards = 0
        self.replication = 0
        self.members: dict[str, Member] = {}
        self.pins: dict[str, int] = {}
        self.target: list[tuple[str, ...]] = []
        self.holders: list[set[str]] = []
        self.lost_shards = 0
        self._placed_for: tuple[tuple[str, int], ...] | None = None

    # -- applying commands ------------------------------------------------------------

    def apply(self, command: Command) -> Result:
        try:
            op = Op(command["op"])
            handler = getattr(self, f"_apply_{op.value}")
            detail = handler(command)
        except (CommandRejected, KeyError, TypeError, ValueError) as exc:
            return {"ok": False, "epoch": self.epoch, "error": f"{type(exc).__name__}: {exc}"}
        self.epoch += 1
        self._reconcile()
        return {"ok": True, "epoch": self.epoch, **(detail or {})}

    def _apply_bootstrap(self, c: Command) -> None:
        if self.members or self.num_shards:
            raise CommandRejected("cluster already bootstrapped")
        num_shards, replication = int(c["num_shards"]), int(c["replication"])
        if num_shards < 1 or replication < 1:
            raise CommandRejected("num_shards and replication must be >= 1")
        member = replace(self._member_from(c["member"], MemberState.UP, incarnation=1), since=1)
        self.num_shards, self.replication = num_shards, replication
        self.members[member.node_id] = member
        # No data exists yet, so the first node holds every shard without catching up.
        self.holders = [{member.node_id} for _ in range(num_shards)]
        self.target = [(member.node_id,)] * num_shards

    def _apply_joining(self, c: Command) -> None:
        self._require_bootstrapped()
        old = self.members.get(c["member"]["node_id"])
        # A (re)joining node's new life begins now, not at ``up``: frames packed before
        # this epoch were meant for its previous life (``cluster.fencing``), and a node
        # catching up must not apply them either.
        member = replace(self._member_from(c["member"], MemberState.JOINING,
                                           incarnation=old.incarnation if old else 0),
                         since=self.epoch + 1)
        self.members[member.node_id] = member
        self._drop_holder(member.node_id, keep_last=True)

    def _apply_up(self, c: Command) -> dict[str, Any]:
        member = self._member(c["node_id"])
        if member.state is not MemberState.JOINING:
            raise CommandRejected(f"{member.node_id} is {member.state}, not joining")
        up = replace(member, state=MemberState.UP, incarnation=member.incarnation + 1,
                     since=self.epoch + 1)
        self.members[up.node_id] = up
        return {"incarnation": up.incarnation}

    def _apply_down(self, c: Command) -> None:
        member = self._member(c["node_id"])
        if member.incarnation != int(c["incarnation"]):
            raise CommandRejected(f"{member.node_id} incarnation is {member.incarnation}")
        if member.state is MemberState.DOWN:
            raise CommandRejected(f"{member.node_id} is already down")
        self.members[member.node_id] = replace(member, state=MemberState.DOWN)
        self._drop_holder(member.node_id, keep_last=True)

    def _apply_leaving(self, c: Command) -> None:
        member = self._member(c["node_id"])
        if member.state is not MemberState.UP:
            raise CommandRejected(f"{member.node_id} is {member.state}, not up")
        self.members[member.node_id] = replace(member, state=MemberState.LEAVING)

    def _apply_remove(self, c: Command) -> None:
        member = self._member(c["node_id"])
        del self.members[member.node_id]
        self._drop_holder(member.node_id)

    def _apply_caught_up(self, c: Command) -> dict[str, Any]:
        member = self._member(c["node_id"])
        if member.state is not MemberState.UP or member.incarnation != int(c["incarnation"]):
            raise CommandRejected(
                f"{member.node_id} is {member.state} incarnation {member.incarnation}"
            )
        accepted = 0
        for shard in c["shards"]:
            shard = int(shard)
            if 0 <= shard < self.num_shards and member.node_id in self.target[shard]:
                self.holders[shard].add(member.node_id)
                accepted += 1
        return {"accepted": accepted}

    def _apply_pin(self, c: Command) -> dict[str, Any]:
        self._require_bootstrapped()
        subtree = normalize_subtree(str(c["subtree"]))
        shard = c.get("shard")
        shard = shard_of(subtree, self.num_shards) if shard is None else int(shard)
        if not 0 <= shard < self.num_shards:
            raise CommandRejected(f"shard {shard} out of range 0..{self.num_shards - 1}")
        self.pins[subtree] = shard
        return {"shard": shard}

    def _apply_unpin(self, c: Command) -> None:
        subtree = normalize_subtree(str(c["subtree"]))
        if self.pins.pop(subtree, None) is None:
            raise CommandRejected(f"{subtree!r} is not pinned")

    # -- helpers ----------------------------------------------------------------------

    def _require_bootstrapped(self) -> None:
        if not self.num_shards:
            raise CommandRejected("cluster not bootstrapped")

    def _member(self, node_id: Any) -> Member:
        member = self.members.get(str(node_id))
        if member is None:
            raise CommandRejected(f"unknown member {node_id!r}")
        return member

    @staticmethod
    def _member_from(info: Mapping[str, Any], state: MemberState, incarnation: int) -> Member:
        weight = int(info.get("weight", 1))
        if weight < 1:
            raise CommandRejected("weight must be >= 1")
        mqtt = info.get("mqtt")
        return Member(
            node_id=str(info["node_id"]),
            mqtt=None if mqtt is None else str(mqtt),
            cluster=str(info["cluster"]),
            raft=str(info["raft"]),
            state=state,
            incarnation=incarnation,
            weight=weight,
        )

    def _drop_holder(self, node_id: str, *, keep_last: bool = False) -> None:
        """``node_id`` holds nothing any more; with ``keep_last``, except the shards whose
        only holder it is (see the module docstring)."""
        for held in self.holders:
            if not (keep_last and len(held) == 1):
                held.discard(node_id)

    def _reconcile(self) -> None:
        """Recompute targets if the UP set changed, then apply the holding rules."""
        if not self.num_shards:
            return
        eligible = tuple(
            sorted((m.node_id, m.weight) for m in self.members.values()
                   if m.state is MemberState.UP)
        )
        if eligible != self._placed_for:
            self.target = list(place_shards(dict(eligible), self.num_shards, self.replication))
            self._placed_for = eligible
        for shard, target in enumerate(self.target):
            held = self.holders[shard]
            if not held and target:
                self.lost_shards += 1
                held.update(target)
            elif held.issuperset(target) and target:
                held.intersection_update(target)

    # -- reading ----------------------------------------------------------------------

    def assignment(self, shard: int) -> ShardAssignment:
        target, held = self.target[shard], self.holders[shard]
        ready = [n for n in target if n in held]
        pending = [n for n in target if n not in held]
        donors = sorted(n for n in held if n not in target) if pending else []
        return ShardAssignment(tuple(ready + donors + pending), frozenset(pending))

    def view(self, leader: str | None = None) -> ClusterView:
        """An immutable snapshot of this state (``leader`` comes from Raft, not the log)."""
        return ClusterView(
            epoch=self.epoch,
            leader=leader,
            num_shards=max(self.num_shards, 1),
            replication=max(self.replication, 1),
            members=MappingProxyType(dict(sorted(self.members.items()))),
            shards=tuple(self.assignment(s) for s in range(self.num_shards)),
            pins=MappingProxyType(dict(sorted(self.pins.items()))),
        )
