"""One signal for "this node's view or ownership changed": a new epoch, shards loaded.

Everything in the cluster layer that retries "by the newer view" (a forward whose owner
died, a delivery whose session shard moved, a replica write, a handoff) waits on it with a
bound instead of polling, so a retry happens as soon as there is something new to decide
by, and never later than its timeout.  Built once by the data plane and handed to the parts
that wait or notify.
"""

from __future__ import annotations

import trio


class ViewChanges:
    def __init__(self) -> None:
        self._event = trio.Event()

    def notify(self) -> None:
        """Wake every waiter (each waits again on a fresh event)."""
        event, self._event = self._event, trio.Event()
        event.set()

    async def wait(self, timeout: float) -> None:
        """Return at the next change, or after ``timeout`` seconds, whichever is first."""
        with trio.move_on_after(timeout):
            await self._event.wait()
