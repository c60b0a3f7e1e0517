"""The QoS 2 message identities a session got lately (``Session.recent_qos2``).

Why: a cluster node that does not get the answer to a publish or a delivery retries it,
and where the first attempt had arrived the retry is a second copy of the message
(``docs/design.md``, "QoS 2 copies made by retries").  A QoS 2 publish carries one identity
(``Message.mid``) over every hop and retry, so a session that remembers the identities it
got takes the copy once.  Retries stop after a bounded time (``cluster_write_patience`` at
the edge, then again at the owner), so an identity is kept for ``horizon`` seconds and no
longer, and never more than ``limit`` of them: memory follows the session's recent QoS 2
rate, not its history.

A deque for the order and a dict for the lookup: forgetting the oldest is O(1) (popping the
first key of a dict is not, once many have been deleted from its front).
"""

from __future__ import annotations

from collections import deque


class RecentIds:
    __slots__ = ("_at", "_order", "horizon", "limit")

    def __init__(self, limit: int, horizon: float) -> None:
        self.limit = limit
        self.horizon = horizon
        self._order: deque[int] = deque()
        #: identity -> when it came (the caller's clock; 0: unknown, forgotten by count only)
        self._at: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self._order)

    def came_since(self, mid: int, since: float) -> bool:
        """Whether ``mid`` was noted (``seen_before``) at ``since`` or later; notes nothing."""
        at = self._at.get(mid)
        return at is not None and at >= since

    def seen_before(self, mid: int, now: float) -> bool:
        """Whether ``mid`` came within the horizon; notes it if not."""
        at = self._at
        if mid in at:
            return True
        order = self._order
        if now:
            oldest = now - self.horizon
            while order and 0 < at[order[0]] < oldest:
                del at[order.popleft()]
        order.append(mid)
        at[mid] = now
        if len(order) > self.limit:
            del at[order.popleft()]
        return False
