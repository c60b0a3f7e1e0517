"""``BrokerNode``'s plain-Python API: the node in a background thread of its own.

Apart from ``mqttring.broker.server`` because it is a second idea: the same ``serve`` run by
a thread with its own trio loop, started and stopped from a program that is not a trio
program, and every way that can go wrong between two threads (a node that never listens, a
``stop`` while it is still starting, a thread that outlives its bound).  ``BrokerNode``
inherits it; what it uses of the node is declared below.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import TYPE_CHECKING

import trio

from mqttring.errors import sole_exception

if TYPE_CHECKING:
    from mqttring.broker.membership import ClusterMember
    from mqttring.broker.router import Router
    from mqttring.broker.server import BoundPorts
    from mqttring.config import BrokerConfig
    from mqttring.lsm import LsmStore

log = logging.getLogger("mqttring.broker")

#: Seconds past ``config.leave_timeout`` allowed for the last hand-offs and Raft removal.
LEAVE_SLACK = 15.0


class BackgroundThread:
    """``start``/``stop`` for ``BrokerNode`` (see the module docstring)."""

    # What the node provides (``BrokerNode.__init__`` and ``serve``).
    config: BrokerConfig
    store: LsmStore | None
    plane: ClusterMember | None
    router: Router | None
    _thread: threading.Thread | None
    _token: trio.lowlevel.TrioToken | None
    _stop_requested: trio.Event | None
    _left_event: trio.Event
    serve: Callable[..., Awaitable[None]]
    leave_cluster: Callable[[], Awaitable[bool]]

    #: Seconds a cancelled background broker gets to end (close its store) before
    #: ``start``/``stop`` give up waiting for its thread.
    halt_grace: float = 10.0

    def start(self, timeout: float = 30.0) -> BoundPorts:
        """Run the broker in a background thread; returns once it listens.

        A failure to start is raised here as itself (a busy port: ``ListenError``, an
        ``OSError`` naming the address), not as trio's exception group.  A broker that does
        not listen within ``timeout`` seconds (a cluster ``join`` address nobody answers) is
        cancelled and its thread waited for (``halt_grace``), then ``TimeoutError`` names
        what it was still waiting for: the caller gave up on it, so it must not go on
        holding its ports, its store and its threads behind the caller's back.
        ``RuntimeError``: ``stop()`` was called (from another thread) before it listened.
        """
        if self._thread is not None:
            raise RuntimeError("broker already started")
        config = self.config
        #: The bound ports, the failure to start (raised here), or None: halted first.
        result: queue.Queue[BoundPorts | BaseException | None] = queue.Queue()
        started = threading.Event()
        # ``stop`` asks a listening broker to stop gracefully (``_stop_requested``, after
        # which it leaves its cluster); that is only awaited once it listens, so a broker
        # still starting, or one past ``stop``'s timeout, is cancelled instead, through
        # ``everything``.  ``halt`` covers a halt that comes before the loop has a token.
        halt = threading.Event()
        everything = trio.CancelScope()
        self._token = self._stop_requested = None
        self.plane = self.router = None  # progress, for the timeout's message

        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            stop = self._stop_requested = trio.Event()
            with everything:
                if halt.is_set():
                    everything.cancel()
                async with trio.open_nursery() as nursery:
                    result.put(await nursery.start(self.serve))
                    started.set()
                    async with trio.open_nursery() as first:  # stop(), or a remote leave

                        async def until(event: trio.Event) -> None:
                            await event.wait()
                            first.cancel_scope.cancel()

                        first.start_soon(until, stop)
                        first.start_soon(until, self._left_event)
                    await self.leave_cluster()  # nothing to do after a remote leave
                    nursery.cancel_scope.cancel()
            if not started.is_set():
                result.put(None)

        def run() -> None:
            try:
                trio.run(main)
            except BaseException as exc:
                if started.is_set():
                    log.exception("broker thread failed")
                else:
                    result.put(sole_exception(exc))  # start() raises it

        def end(at_once: bool) -> None:
            """From any thread: stop gracefully, or (``at_once``, or not listening yet)
            cancel everything."""
            token, stop = self._token, self._stop_requested
            if at_once or not started.is_set() or token is None or stop is None:
                halt.set()  # before reading the token: ``main`` sets it, then reads this
                token = self._token
                action = everything.cancel
            else:
                action = stop.set
            if token is not None:
                with suppress(trio.RunFinishedError):
                    token.run_sync_soon(action)

        def waiting_for() -> str:
            """What a broker that is not listening yet is still doing (for the error)."""
            if config.data_dir is not None and self.store is None:
                return f"opening its store in {config.data_dir}"
            if self.plane is not None and self.router is None:
                if config.join is not None:
                    return (f"joining the cluster through {config.join} (is that member up "
                            "and reachable, with the same cluster_secret?)")
                return "waiting for its cluster's Raft majority to answer"
            return "restoring its sessions or opening its listeners"

        thread = self._thread = threading.Thread(target=run, name="mqttring-broker",
                                                  daemon=True)
        self._end_thread: Callable[[bool], None] = end  # for ``stop``
        thread.start()
        try:
            outcome = result.get(timeout=timeout)
        except queue.Empty:
            doing = waiting_for()
            end(True)
            thread.join(self.halt_grace)
            message = (f"node {config.node_id} did not start within {timeout:g} s: it was "
                       f"still {doing}")
            if thread.is_alive():
                raise TimeoutError(f"{message}; it is still stopping (stop() waits for "
                                   "it)") from None
            self._thread = None
            late = None if result.empty() else result.get_nowait()
            raise TimeoutError(message) from (late if isinstance(late, BaseException)
                                              else None)
        if outcome is None or isinstance(outcome, BaseException):
            thread.join()  # ending already: it has nothing left to do
            self._thread = None
            if outcome is None:
                raise RuntimeError(f"node {config.node_id} was stopped (stop()) before it "
                                   "started listening")
            raise outcome
        return outcome

    def stop(self, timeout: float | None = None) -> None:
        """Shut the background broker down cleanly (leaving its cluster first, if a member
        with ``leave_on_stop``) and wait for it, at most ``timeout`` seconds (default: the
        leave's bound plus 30 s).

        A broker still starting (``start`` waiting in another thread, or one that timed
        out) is cancelled at once.  Past ``timeout`` the rest (a leave) is cancelled, and
        the thread gets ``halt_grace`` more seconds; a thread still running then raises
        ``TimeoutError`` (call ``stop`` again to wait longer) rather than returning as if
        the node, its ports and its store were gone.
        """
        thread = self._thread
        if thread is None:
            return
        if timeout is None:
            timeout = self.config.leave_timeout + LEAVE_SLACK + 30.0
        self._end_thread(False)
        thread.join(timeout)
        if thread.is_alive():
            self._end_thread(True)
            thread.join(self.halt_grace)
            if thread.is_alive():
                raise TimeoutError(f"node {self.config.node_id}: its broker thread did not "
                                   f"end within {timeout + self.halt_grace:g} s of stop()")
        if self._thread is thread:
            self._thread = None
