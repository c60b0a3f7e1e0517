"""``LifeTasks``: the tasks one life of a node started, ended together.

A node that the cluster declared down (cut off by a partition, say) keeps running, and the
tasks it started in that life (accepting a publish under a view the cluster has moved past,
delivering to peers) would otherwise go on after it rejoins, and their messages would leave
stamped with the new incarnation, which peers accept.  So every cluster task belongs to the
life that started it, and ``end`` cancels them all when the node learns it was declared
down (``DataPlane._end_life``).

A task is registered when it is spawned, not when it first runs: a task spawned just before
the life ended (a frame handled in the same scheduler batch as the view that says we were
declared down) never runs at all, not even its first synchronous steps.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from mqttring.cluster.errors import PeerFailure
from mqttring.lsm import StoreError

log = logging.getLogger(__name__)


class LifeTasks:
    """Cancel scopes of the tasks started by the current life of this node."""

    def __init__(self) -> None:
        self._scopes: set[trio.CancelScope] = set()

    def __len__(self) -> int:
        return len(self._scopes)

    def spawn(self, nursery: trio.Nursery, fn: Callable[..., Awaitable[Any]],
              *args: Any) -> None:
        """Run ``fn(*args)`` in ``nursery`` as a task of this life."""
        scope = trio.CancelScope()
        self._scopes.add(scope)
        nursery.start_soon(self._guarded, scope, fn, *args)

    def end(self) -> int:
        """Cancel every task of this life (started or not yet); how many there were."""
        ended = len(self._scopes)
        for scope in self._scopes:
            scope.cancel()
        self._scopes.clear()
        return ended

    async def _guarded(self, scope: trio.CancelScope, fn: Callable[..., Awaitable[Any]],
                       *args: Any) -> None:
        try:
            if scope.cancel_called:
                return  # its life ended before it started
            with scope:
                await fn(*args)
        except (PeerFailure, StoreError) as exc:
            # A peer's failure is an expected event under faults, not a bug of ours; so is
            # a failed store, which stops the node (``BrokerNode._stop_when_store_fails``).
            log.warning("cluster task %s: %s", getattr(fn, "__name__", fn), exc)
        except Exception:
            # One message's failure must not take the node down with it.
            log.exception("cluster task %s failed", getattr(fn, "__name__", fn))
        finally:
            self._scopes.discard(scope)


__all__ = ["LifeTasks"]
