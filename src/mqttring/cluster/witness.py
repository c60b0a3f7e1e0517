"""Witnesses: a second record of a share's copy that a clean member holds unacknowledged.

Theory of operation
-------------------
The owner O of a topic places each QoS 1/2 message of a share with one member
(``mqttring.cluster.shared``) and acknowledges the publisher once it is placed.  A clean
member's copy lives only in its node's memory, so something must remember that the member
has it until the client acknowledges it, to give the copy to another member if the member's
node dies first.  For a member on another node M, O remembers (``ShareDispatch.
unconfirmed``).  For a member on O itself that record would die with O: one failure (O's)
would lose messages whose publisher had its PUBACK.  So O also records such a copy, before
it acknowledges the publisher, at a *witness* W: the first live node of the topic shard's
preference list (its replicas in ring order, then every other live node) that is neither O
nor M.  W is usually the shard's next owner.

* O -> W ``ShareTrack`` (a request, answered once recorded) in the same round as the
  delivery; O acknowledges the publisher only once W answered.  No witness is left (a
  one-node cluster): nothing to record, nothing promised beyond the node's life.
* The copy is gone (acknowledged, or handed back when the member ended): O tells W with
  ``SharedDone(tokens, origin=O)``, batched with O's other reports every 0.1 s.  A copy the
  member declined is cancelled the same way.  Reports may overtake the record they cancel
  (a ``ShareTrack`` waiting behind back-pressure): W keeps a bounded set of tokens reported
  gone before they were recorded and skips them when the record comes (tokens are unique
  across O's restarts: they start at O's clock in microseconds).
* O leaves the view: W places again (through the topic's new owner) every record of O's
  whose member node has left too; with M = O that is every record of O's.
* W leaves the view, O lives: O sends its outstanding records to a new witness.

Decisions here are plain objects over (view, records, message) returning what to send or
place; ``ShareDispatch`` performs them.  Both sides are bounded (``MAX_RECORDS``: past it
the oldest record is forgotten and counted, as ``MAX_UNCONFIRMED`` is).
"""

from __future__ import annotations

from collections.abc import Iterable

from mqttring.broker.shared import SharedMessage
from mqttring.raft.view import ClusterView

__all__ = ["OwnCopies", "WitnessBook", "choose_witness"]

#: Records kept per origin (witness side) and in all (owner side); as ``MAX_UNCONFIRMED``.
MAX_RECORDS = 100_000
#: Tokens reported gone before their record came, kept per origin.
MAX_EARLY_DONE = 10_000


def choose_witness(view: ClusterView, shard: int, exclude: Iterable[str]) -> str | None:
    """The first live node of ``shard``'s preference list not in ``exclude`` (the owner and
    the member's node): its replicas in ring order, then every other live node."""
    live = view.live_members()
    skip = set(exclude)
    for node in (*view.replicas(shard), *live):
        if node not in skip and node in live:
            return node
    return None


class OwnCopies:
    """Owner side: copies placed with clean members on this node, each with its witness,
    until they are gone."""

    __slots__ = ("records",)

    def __init__(self) -> None:
        #: token -> (copy, witness or None when no witness could be had).
        self.records: dict[int, tuple[SharedMessage, str | None]] = {}

    def add(self, token: int, copy: SharedMessage, witness: str | None) -> int:
        """Keep ``copy`` (recorded at ``witness``); returns how many records were forgotten
        to make room (0 or 1)."""
        records = self.records
        dropped = 0
        if len(records) >= MAX_RECORDS:
            del records[next(iter(records))]
            dropped = 1
        records[token] = (copy, witness)
        return dropped

    def moved(self, tokens: Iterable[int], witness: str | None) -> None:
        """These records are at ``witness`` now (None: at none; the next view change tries
        again), not where ``add`` said."""
        records = self.records
        for token in tokens:
            record = records.get(token)
            if record is not None:
                records[token] = (record[0], witness)

    def gone(self, tokens: Iterable[int]) -> dict[str, list[int]]:
        """The copies are gone here: forget them; witness -> tokens to tell it."""
        tell: dict[str, list[int]] = {}
        records = self.records
        for token in tokens:
            record = records.pop(token, None)
            if record is not None and record[1] is not None:
                tell.setdefault(record[1], []).append(token)
        return tell

    def rewitness(self, view: ClusterView, me: str
                  ) -> dict[str, list[tuple[int, SharedMessage]]]:
        """Records whose witness left ``view`` (or that had none): new witness -> records to
        send it.  Records for which no witness is left keep None."""
        live = view.live_members()
        moved: dict[str, list[tuple[int, SharedMessage]]] = {}
        records = self.records
        for token, (copy, witness) in list(records.items()):
            if witness is not None and witness in live:
                continue
            new = choose_witness(view, view.shard_for_topic(copy.topic), (me,))
            if new is None:
                if witness is not None:
                    records[token] = (copy, None)
                continue
            records[token] = (copy, new)
            moved.setdefault(new, []).append((token, copy))
        return moved


class WitnessBook:
    """Witness side: other owners' records of copies held by clean members, until the copy
    is reported gone or must be placed again."""

    __slots__ = ("_early", "records")

    def __init__(self) -> None:
        #: origin -> token -> (member node, copy).
        self.records: dict[str, dict[int, tuple[str, SharedMessage]]] = {}
        #: origin -> tokens reported gone before they were recorded (as a bounded set).
        self._early: dict[str, dict[int, None]] = {}

    def __len__(self) -> int:
        return sum(len(r) for r in self.records.values())

    def track(self, origin: str, member: str,
              entries: Iterable[tuple[int, SharedMessage]]) -> int:
        """``origin`` placed these copies with clean members on ``member``; returns how many
        older records were forgotten to make room."""
        records = self.records.setdefault(origin, {})
        early = self._early.get(origin)
        dropped = 0
        for token, copy in entries:
            if early is not None and early.pop(token, 0) is None:
                continue  # already reported gone
            if len(records) >= MAX_RECORDS:
                del records[next(iter(records))]
                dropped += 1
            records[token] = (member, copy)
        return dropped

    def done(self, origin: str, tokens: Iterable[int]) -> None:
        """These copies of ``origin``'s are gone: nothing to place again for them."""
        records = self.records.get(origin, {})
        early: dict[int, None] | None = None
        for token in tokens:
            if records.pop(token, None) is None:
                if early is None:
                    early = self._early.setdefault(origin, {})
                if len(early) >= MAX_EARLY_DONE:
                    del early[next(iter(early))]
                early[token] = None

    def lost(self, view: ClusterView) -> list[SharedMessage]:
        """The copies to place again under ``view``: records of origins that left it whose
        member node left it too (forgotten here once returned)."""
        live = set(view.live_members())
        lost: list[SharedMessage] = []
        for origin in [o for o in self.records if o not in live]:
            records = self.records[origin]
            for token, (member, copy) in list(records.items()):
                if member not in live:
                    del records[token]
                    lost.append(copy)
            if not records:
                del self.records[origin]
                self._early.pop(origin, None)
        return lost
