"""One lock per key (a client id), kept only while someone holds or waits for it.

A node takes a client id's turn for what must happen to it one step at a time: a single
node's CONNECTs of one id (``LocalSessions.open``), a cluster home's registration, binding
and close of one (``cluster/registrations.py``).  Locks are made on demand and forgotten
when free, so memory follows the ids in contention, not every id ever seen.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


class IdLocks:
    __slots__ = ("_locks",)

    def __init__(self) -> None:
        self._locks: dict[str, trio.Lock] = {}

    def __len__(self) -> int:
        return len(self._locks)

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock = self._locks.setdefault(key, trio.Lock())
        try:
            async with lock:
                yield
        finally:
            if self._locks.get(key) is lock and not lock.locked() \
                    and not lock.statistics().tasks_waiting:
                del self._locks[key]
