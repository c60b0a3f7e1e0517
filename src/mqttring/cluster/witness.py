"""Witnesses: a second record of a share's copy that a clean member holds unacknowledged.

Theory of operation
-------------------
The owner O of a topic places each QoS 1/2 message of a share with one member
(``mqttring.cluster.shared``) and acknowledges the publisher once it is placed.  A clean
member's copy lives only in its node's memory, so something must remember that the member
has it until the client acknowledges it, to give the copy to another member if the member's
node M dies first.  O remembers (``ShareDispatch.unconfirmed``), but that record dies with
O: O dying alone loses the copies of its own members (M = O; with ``local_first`` the
common placement), and O dying together with M loses M's.  So O also records each tracked
copy, before it acknowledges the publisher, at a *witness* W: the first live node of the
topic shard's preference list (its replicas in ring order, then every other live node) that
is neither O nor M.  W is usually the shard's next owner.  Two failures at once are the
promise, as for R=2 replicas.

* O -> W ``ShareTrack(member=M)`` (a request, answered once recorded) in the round that
  places the copies, beside the ``Dlv``; O acknowledges the publisher only once W answered
  (a W that does not answer is replaced by the next candidate).  The ``DlvEntry`` names W.
  No witness is left (one or two live nodes): nothing recorded, nothing more promised.
* The copy is gone (acknowledged, or handed back when the member ended): M tells O
  (``SharedDone``) and W (``SharedDone(origin=O)``), batched every 0.1 s; for M = O, O tells
  W.  A copy the member declined is cancelled at W by O.  Reports may overtake the record
  they cancel (a ``ShareTrack`` waiting behind back-pressure): W keeps a bounded set of
  tokens reported gone before they were recorded and skips them when the record comes
  (tokens are unique across O's restarts: they start at O's clock in microseconds).
* M leaves, O lives: O places M's copies again, then tells W to forget them (so O dying in
  between loses nothing).  O leaves, M lives: W keeps O's records for M until M reports
  them gone (orphaned: apart from O's, so that O restarting under its node id does not
  make them look looked after again).  O and M both left (in one view change or two): W
  places again (through the topic's new owner) every record of O's for M; with M = O,
  every record of O's.
* W leaves, O lives: O sends its outstanding records to a new witness, and from then on
  forwards M's reports of them (M still names the old W).

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
    """Owner side: each tracked copy (with a clean member here or on another node), with
    its witness, until it is gone."""

    __slots__ = ("records",)

    def __init__(self) -> None:
        #: token -> (copy, witness or None when none could be had, member's node, whether
        #: the member reports it gone to that witness itself).
        self.records: dict[int, tuple[SharedMessage, str | None, str, bool]] = {}

    def add(self, token: int, copy: SharedMessage, witness: str | None, member: str,
            direct: bool) -> int:
        """Keep ``copy``, placed with a clean member on ``member``, recorded at ``witness``
        (``direct``: the member was told that witness, in the ``DlvEntry``); returns how many
        records were forgotten to make room (0 or 1)."""
        records = self.records
        dropped = 0
        if len(records) >= MAX_RECORDS:
            del records[next(iter(records))]
            dropped = 1
        records[token] = (copy, witness, member, direct)
        return dropped

    def moved(self, tokens: Iterable[int], witness: str | None) -> None:
        """These records are at ``witness`` now (None: at none; the next view change tries
        again), not where the member was told: from now on we tell it when they are gone."""
        records = self.records
        for token in tokens:
            record = records.get(token)
            if record is not None:
                records[token] = (record[0], witness, record[2], False)

    def gone(self, tokens: Iterable[int], *, told: bool) -> dict[str, list[int]]:
        """The copies are gone (or placed again by us): forget them; witness -> tokens to
        tell it.  ``told``: the member reported them, to the witnesses it was given too."""
        tell: dict[str, list[int]] = {}
        records = self.records
        for token in tokens:
            record = records.pop(token, None)
            if record is not None and record[1] is not None and not (told and record[3]):
                tell.setdefault(record[1], []).append(token)
        return tell

    def rewitness(self, view: ClusterView, me: str
                  ) -> dict[tuple[str, str], list[tuple[int, SharedMessage]]]:
        """Records whose witness left ``view`` (or that had none), of members still in it:
        (new witness, member) -> records to send it.  Records for which no witness is left
        keep None.  Records of members that left are dropped: the caller placed again what
        it still tracked (``ShareDispatch.unconfirmed``) before."""
        live = view.live_members()
        moved: dict[tuple[str, str], list[tuple[int, SharedMessage]]] = {}
        records = self.records
        for token, (copy, witness, member, _) in list(records.items()):
            if member not in live:
                del records[token]
                continue
            if witness is not None and witness in live:
                continue
            new = choose_witness(view, view.shard_for_topic(copy.topic), (me, member))
            if new is None:
                if witness is not None:
                    records[token] = (copy, None, member, False)
                continue
            records[token] = (copy, new, member, False)
            moved.setdefault((new, member), []).append((token, copy))
        return moved


class WitnessBook:
    """Witness side: other owners' records of copies held by clean members, until the copy
    is reported gone or must be placed again.

    Records of an owner that left the view while their member lives are *orphaned*: kept
    by (owner, token) apart from the owner's, so that the owner coming back (a restart
    keeps its node id) does not make them look looked after again; the member still reports
    them gone under the owner's name, and they are placed again when it leaves."""

    __slots__ = ("_early", "dropped", "orphans", "records")

    def __init__(self) -> None:
        #: origin -> token -> (member node, copy).
        self.records: dict[str, dict[int, tuple[str, SharedMessage]]] = {}
        #: (origin that left, token) -> (member node, copy).
        self.orphans: dict[tuple[str, int], tuple[str, SharedMessage]] = {}
        #: origin -> tokens reported gone before they were recorded (as a bounded set).
        self._early: dict[str, dict[int, None]] = {}
        #: Records forgotten because ``MAX_RECORDS`` were kept (per origin, or orphaned).
        self.dropped = 0

    def __len__(self) -> int:
        return sum(len(r) for r in self.records.values()) + len(self.orphans)

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
        self.dropped += dropped
        return dropped

    def done(self, origin: str, tokens: Iterable[int]) -> None:
        """These copies of ``origin``'s are gone: nothing to place again for them."""
        records = self.records.get(origin, {})
        orphans = self.orphans
        early: dict[int, None] | None = None
        for token in tokens:
            if records.pop(token, None) is not None:
                continue
            if orphans and orphans.pop((origin, token), None) is not None:
                continue
            if early is None:
                early = self._early.setdefault(origin, {})
            if len(early) >= MAX_EARLY_DONE:
                del early[next(iter(early))]
            early[token] = None

    def lost(self, view: ClusterView) -> list[SharedMessage]:
        """The copies to place again under ``view``: records of origins that left it whose
        member node left it too (forgotten here once returned); the other records of those
        origins are orphaned (their member still reports them)."""
        live = set(view.live_members())
        lost: list[SharedMessage] = []
        orphans = self.orphans
        for origin in [o for o in self.records if o not in live]:
            for token, (member, copy) in self.records.pop(origin).items():
                if member not in live:
                    lost.append(copy)
                    continue
                if len(orphans) >= MAX_RECORDS:
                    del orphans[next(iter(orphans))]
                    self.dropped += 1
                orphans[(origin, token)] = (member, copy)
            self._early.pop(origin, None)
        for key, (member, copy) in list(orphans.items()):
            if member not in live:
                del orphans[key]
                lost.append(copy)
        return lost
